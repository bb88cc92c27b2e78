"""The per-step forward context: what a model reads about the current step, set by the runner.

The runner sets it around one forward (``with forward_context(ctx): model(...)``); the model and
its eager regions read it with ``get_forward_context()``. It lives in ``graphs`` because it is
shared vocabulary: the model (``dsv4``) may not import the runners.

Invariants:
- Eager segments read the context at the time they run, so on replay they see the metadata of
  the step being replayed; captured work saw the context once, at capture.
- Contexts nest and are restored on exit; outside any ``forward_context`` reading raises.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import attrs

__all__ = ["ForwardContext", "forward_context", "get_forward_context"]


@attrs.frozen(kw_only=True)
class ForwardContext:
    """What one forward step knows about itself.

    ``attn_metadata`` is the model's attention metadata for this step (its type belongs to the
    model); ``batch_descriptor`` and ``runtime_mode`` are the runner's dispatch key and the graph
    mode this step runs under (``None`` when running eagerly outside a runner).
    """

    attn_metadata: Any
    batch_descriptor: Any = None
    runtime_mode: Any = None


_state = threading.local()


def get_forward_context() -> ForwardContext:
    """The context of the step running on this thread; raises if no step is running."""
    ctx: ForwardContext | None = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context is set: run the model inside forward_context(...)")
    return ctx


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Set ``ctx`` for the duration of the block, restoring the previous one afterwards."""
    previous = getattr(_state, "ctx", None)
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = previous
