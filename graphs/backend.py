"""The protocol every graph backend implements: begin a segment, end it, replay it, share a pool.

A backend records the work issued between ``begin_segment`` and ``end_segment`` into a
replayable segment. Replaying a segment re-executes exactly that work against the same memory,
with every host-side decision (shapes, Python scalars, branch outcomes) frozen as it was at
capture — as a CUDA graph does. Eager segments are not the backend's business: the capture runs
them itself, between a segment's end and the next one's beginning.

What every backend shares with CUDA graphs (DESIGN §4):
- Recording is not execution: right after ``end_segment`` the memory the segment produced holds
  junk (stale pool bytes on CUDA, NaN or an out-of-range integer on the tape) until the segment
  is replayed, and memory it wrote from outside still holds what it held before.
- A pool outlives none of its graphs' uses: every segment begun takes a use of the pool, also
  one that records nothing, and once every use is given back the pool is *retired* and never
  recorded into again (``PoolGraphs``); ``begin_segment`` raises ``CaptureError`` for a retired
  pool on every backend.
- A failed ``begin_segment``, ``end_segment`` or ``abort_segment`` leaves the backend not
  recording (and, on CUDA, the caller's stream current), so the next attempt can begin.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from typing_extensions import Protocol, runtime_checkable

from graphs.errors import CaptureError

__all__ = ["GraphBackend", "GraphSegment", "PoolGraphs", "PoolUse"]


class PoolUse:
    """One graph's use of a memory pool, held by whatever holds the graph: it is given back when
    that goes (a CUDA graph's destructor gives back the use ``capture_begin`` took)."""

    __slots__ = ("__weakref__",)


class PoolGraphs:
    """The uses of one memory pool by graphs, to tell when the pool is retired.

    As on CUDA, every segment begun takes a use (``take``), also one that records nothing, and
    the use is given back when the ``PoolUse`` goes (with its graph).

    Invariant: ``retired`` is true once at least one use was taken and none is held any more.
    CUDA's allocator asserts when a capture reuses such a pool (``use_count > 0``); every backend
    refuses it outright, so the CPU shows the same error.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakSet[PoolUse] = weakref.WeakSet()
        self._taken = 0

    def take(self) -> PoolUse:
        """A new use of this pool, held (strongly) by the graph that takes it."""
        use = PoolUse()
        self._live.add(use)
        self._taken += 1
        return use

    @property
    def retired(self) -> bool:
        return self._taken > 0 and not self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    def require_recordable(self) -> None:
        """Raise ``CaptureError`` if the pool is retired."""
        if self.retired:
            raise CaptureError(
                f"this memory pool is retired: all {self._taken} graph(s) recorded into it "
                "are gone, and a pool is never recorded into again once its graphs are gone "
                "(CUDA asserts use_count > 0); record into a fresh pool (a new backend)"
            )


@runtime_checkable
class GraphSegment(Protocol):
    """One recorded stretch of captured work."""

    def replay(self) -> None:
        """Re-run the recorded work against the memory it was captured on."""
        ...


@runtime_checkable
class GraphBackend(Protocol):
    """Records captured work into segments; one instance may record many captures."""

    name: str
    """Stable short name (``tape``, ``cuda-graph``) used in reports."""

    @property
    def pool(self) -> Any:
        """The memory pool shared by every segment this backend records."""
        ...

    def begin_segment(self) -> None:
        """Start recording work issued on this thread into a new segment."""
        ...

    def end_segment(self) -> GraphSegment | None:
        """Stop recording; return the segment, or ``None`` if it recorded no work."""
        ...

    def abort_segment(self) -> None:
        """Stop recording after a failure, discarding the partial segment."""
        ...

    def hold(self, value: Any) -> Any:
        """How an eager segment keeps ``value`` (one of its arguments) for every replay; built
        once, at capture, and passed to the segment's function as it is on each replay.

        On the tape this is the value itself; on CUDA tensors in the graph pool become
        non-owning aliases (the pool keeps their memory reserved), everything else is kept.
        """
        ...

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once eagerly where segments will be captured (CUDA: on the capture stream,
        so library workspaces created lazily by the first call on a stream are made outside any
        graph's pool); a no-op where nothing is created lazily (the tape)."""
        ...
