"""The protocol every graph backend implements: begin a segment, end it, replay it, share a pool.

A backend records the work issued between ``begin_segment`` and ``end_segment`` into a
replayable segment. Replaying a segment re-executes exactly that work against the same memory,
with every host-side decision (shapes, Python scalars, branch outcomes) frozen as it was at
capture — as a CUDA graph does. Eager segments are not the backend's business: the capture runs
them itself, between a segment's end and the next one's beginning.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import Protocol, runtime_checkable

__all__ = ["GraphBackend", "GraphSegment"]


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
        """Return how an eager segment's argument is held until replay.

        On the tape this is the value itself; on CUDA tensors are held without keeping graph
        memory alive. ``release(hold(v))`` must give back a value usable as ``v``.
        """
        ...

    def release(self, held: Any) -> Any:
        """Turn a held argument back into a value for an eager segment's replay."""
        ...
