"""The per-step forward context: what a model reads about the current step, set by the runner.

The runner sets it around one forward (``with forward_context(ctx): model(...)``) — every eager
step and every capture; the model and its eager regions read it with ``get_forward_context()``.
It lives in ``graphs`` because it is shared vocabulary: the model (``dsv4``) may not import the
runners.

Invariants:
- It is the one way a step's metadata, paged caches and eager region reach the model: nothing is
  installed into a model, so several runners may drive one model in turn.
- Eager segments read the context at the time they run, so on replay they see the metadata of
  the step being replayed; captured work saw the context once, at capture (the region included:
  which part of a layer is captured is decided when it is captured).
- Contexts nest and are restored on exit; outside any ``forward_context`` reading raises.
- ``once`` shares a value the layers of one step would each compute alike (addresses derived
  from the metadata, RoPE rows of the step's positions). A context is made anew for every step,
  capture and replay, so a shared value never outlives its step; and since every layer composes
  the same region, a value is computed and reused on the same side of every graph break (all
  captured, or all eager and recomputed on replay).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import attrs

from graphs.strategies import EagerRegionStrategy, NoGraph

__all__ = ["ForwardContext", "forward_context", "get_forward_context"]

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class ForwardContext:
    """What one forward step knows about itself.

    ``attn_metadata`` and ``kv_caches`` are the model's attention metadata for this step and the
    paged caches it reads and writes (their types belong to the model). ``eager_region`` is the
    strategy the attention layers compose their region with; a context that names none gets
    ``NoGraph``, the widest (always safe) region. Outside a capture every region computes the
    same function, so plain eager use need not name one.

    ``collectives_in_graph`` is the platform's capture policy for collectives (tensor-parallel
    all-reduces and all-gathers): ``True`` (CUDA/NCCL) means a collective issued while a graph
    segment records is captured with the graph like any other op; ``False`` (the CPU tape with
    gloo) means each collective runs as an eager break, writing into a buffer allocated before
    the break. Outside a capture both run the collective directly, so eager use need not set it.
    """

    attn_metadata: Any
    kv_caches: Any = None
    eager_region: EagerRegionStrategy = attrs.field(factory=NoGraph)
    collectives_in_graph: bool = True
    step_values: dict[Hashable, Any] = attrs.field(factory=dict, repr=False, eq=False)
    """What ``once`` computed in this step, by key."""

    def once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, computed the first time this step asks for ``key`` and shared after
        (see the module docstring). The key must name everything the value depends on beyond
        the step's metadata."""
        if key not in self.step_values:
            self.step_values[key] = compute()
        value: T = self.step_values[key]
        return value


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
