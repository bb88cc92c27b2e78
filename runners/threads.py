"""How many CPU threads a run uses when the user gives none: the fastest measured for its size.

Measured with ``dsv4 run`` (capture and generation) on a 2-core machine, idle and with both
cores busy: for models up to a hidden size of 512 (the built-in ``tiny`` and ``small`` presets)
one thread is never slower, and on busy cores two threads took 2.3x (tiny) to 4x (small) as long
to capture — threads that wait for each other on tiny matrices. Larger models do enough work per
op to gain from more threads; for them torch's own default stands (one per core).
"""

from __future__ import annotations

import torch

__all__ = ["SINGLE_THREAD_MAX_HIDDEN", "apply_threads", "default_threads"]

SINGLE_THREAD_MAX_HIDDEN = 512
"""Largest hidden size run on one thread by default."""


def default_threads(hidden_size: int) -> int | None:
    """The thread count for a model of ``hidden_size``; ``None`` keeps torch's default."""
    return 1 if hidden_size <= SINGLE_THREAD_MAX_HIDDEN else None


def apply_threads(threads: int | None, hidden_size: int) -> int:
    """Use ``threads`` (the user's choice) or the default for ``hidden_size``; return the
    count in force."""
    chosen = threads if threads is not None else default_threads(hidden_size)
    if chosen is not None:
        torch.set_num_threads(chosen)
    return torch.get_num_threads()
