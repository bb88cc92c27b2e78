"""What the engine reports about itself: after each ``generate`` step, and on demand."""

from __future__ import annotations

import attrs

from runners.engine.prefix_cache import PrefixCacheStats

__all__ = ["EngineStats", "GenerateProgress"]


@attrs.frozen(kw_only=True)
class GenerateProgress:
    """Reported to ``generate``'s ``progress`` callback after every step."""

    finished: int
    """Requests of this ``generate`` call that have finished."""
    total: int
    """Requests of this ``generate`` call."""
    generated_tokens: int
    """Tokens the engine sampled since this call began."""


@attrs.frozen(kw_only=True)
class EngineStats:
    """A snapshot of the engine's queues and cache occupancy."""

    waiting: int
    """Live requests without a row: new ones, and preempted ones waiting to be recomputed."""
    running: int
    free_blocks: int
    """Blocks the engine may allocate now: cached blocks no request holds count as free."""
    total_blocks: int
    free_rows: int
    total_rows: int
    free_entry_blocks: int
    """Entry blocks the engine may allocate now (cached idle ones included)."""
    total_entry_blocks: int
    released_blocks: int
    """Blocks running requests gave back so far, their positions past every layer's lookback."""
    preemptions: int
    """Requests preempted so far (each time, so one request may count more than once): each one
    gave back its blocks and row and is recomputed from its tokens when it resumes."""
    prefix_cache: PrefixCacheStats | None = None
    """The prefix cache's counts; ``None`` when the engine has no prefix cache."""
