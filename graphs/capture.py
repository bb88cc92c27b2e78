"""Breakable capture: a forward pass recorded as graph segments separated by eager breaks.

Use::

    @eager_break_during_capture
    def attend(q, out): ...               # host logic, writes into the buffer it is given

    with BreakableCapture(device=device) as capture:
        out = model(static_inputs)        # graph, eager, graph, ... as the breaks fall
    ...                                   # overwrite the static inputs in place
    capture.replay()                      # `out` now holds the result for the new inputs

Invariants:
- A function decorated with ``eager_break_during_capture`` is a plain call outside a capture.
  Called while a graph segment records, it ends that segment, runs for real, is recorded as an
  eager segment and a new graph segment begins. Inside an eager segment (no graph segment
  records) and inside a FULL capture (``full=True``) it runs inline: a break nested in a wider
  eager region costs nothing and runs again on every replay through the outer one; under FULL
  its work is captured.
- Segments alternate graph / eager in issue order, except that a graph stretch that recorded no
  work is dropped (two breaks back to back give two adjacent eager segments). ``replay`` runs
  them in that order. ``num_graphs`` and ``num_eager_breaks`` count them.
- An eager segment re-runs its function with the very arguments it was captured with; its return
  value is discarded on replay, so eager work must write into caller-provided output buffers.
- Recording is not execution (``graphs.backend``): right after a graph segment is recorded, what
  it produced holds junk. So that eager code never runs on junk, the capture replays each graph
  segment once right after recording it, before the eager break that follows runs — on every
  backend. The last graph segment is not replayed: a capture's outputs hold junk until the first
  ``replay()``.
- The capture is thread-local: at most one is active per thread; entering one while another is
  active in the thread raises ``CaptureError``; leaving the context, normally or by exception,
  always clears it.
- A capture that raised, or that recorded nothing, cannot be replayed (``CaptureError``).
- Replay runs in inference mode exactly when the capture was recorded in it, so eager segments
  may write into the inference tensors the captured work made, wherever replay is called.
- With an audit (``audit="raise"`` or ``"report"``; the default is ``"raise"`` when ``static``
  memory is given and ``"off"`` otherwise) every tensor captured work touches must be produced
  by captured work, be a module parameter, or be registered in ``static``; other accesses raise
  ``CaptureAuditError`` or are collected in ``audit_report`` (see ``graphs.audit``). The audit is
  a dispatch mode active for the whole capture, eager segments included, beneath the backend's.
  It also checks every tensor an eager break is called with: one that captured work did not
  produce and that is neither static nor a parameter would be replayed as its capture-time value
  (and, held by address on CUDA, could dangle) — a finding naming it and where it was allocated.
- Nothing the capture hands out refers back to it (no reference cycle), so a capture and its
  graphs are freed as soon as the last reference to the capture goes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import attrs
import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphs.allocations import AllocationTracker
from graphs.audit import AUDIT_MODES, AuditMode, AuditReport, CaptureAudit
from graphs.backend import GraphBackend, GraphSegment
from graphs.cuda_backend import CudaGraphBackend
from graphs.errors import CaptureError
from graphs.static_memory import StaticMemory
from graphs.tape import TapeBackend

__all__ = ["BreakableCapture", "EagerSegment", "backend_for_device", "eager_break_during_capture"]

R = TypeVar("R")

_active = threading.local()
"""``_active.capture``: the capture active in this thread, if any."""


def backend_for_device(device: torch.device | str) -> GraphBackend:
    """The graph backend for ``device``: the CUDA graph backend on CUDA, the op tape on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaGraphBackend(device=device)
    if device.type == "cpu":
        return TapeBackend()
    raise CaptureError(f"no graph backend for device type {device.type!r} (expected cpu or cuda)")


def _current() -> BreakableCapture | None:
    return getattr(_active, "capture", None)


def eager_break_during_capture(fn: Callable[..., R]) -> Callable[..., R]:
    """Decorate ``fn`` so that it becomes an eager segment when called while a graph records."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        capture = _current()
        if capture is None or capture.full or not capture._recording:
            return fn(*args, **kwargs)
        return capture.add_eager(fn, args, kwargs)

    return wrapper


@attrs.frozen
class EagerSegment:
    """An eager break recorded at capture, re-run on every replay."""

    fn: Callable[..., Any]
    held_args: tuple[Any, ...]
    held_kwargs: dict[str, Any]
    """The arguments as the backend holds them (``GraphBackend.hold``), built once at capture."""

    def replay(self) -> None:
        self.fn(*self.held_args, **self.held_kwargs)


class BreakableCapture:
    """Context manager that records a forward pass into graph and eager segments."""

    def __init__(
        self,
        backend: GraphBackend | None = None,
        *,
        device: torch.device | str = "cpu",
        full: bool = False,
        static: StaticMemory | None = None,
        audit: AuditMode | None = None,
        allocations: AllocationTracker | None = None,
    ) -> None:
        mode: AuditMode = audit if audit is not None else ("raise" if static is not None else "off")
        if mode not in AUDIT_MODES:
            raise ValueError(f"unknown audit mode {audit!r}; expected one of {AUDIT_MODES}")
        self.backend: GraphBackend = backend if backend is not None else backend_for_device(device)
        self.full = full
        self.static = static
        self.audit_mode: AuditMode = mode
        self._allocations = allocations
        self._audit: CaptureAudit | None = None
        self._inference_mode = False
        self._segments: list[GraphSegment | EagerSegment] = []
        self._recording = False
        """Whether a graph segment records now (``_set_recording`` tells the audit too)."""
        self._state = "new"  # new -> capturing -> done | failed

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> BreakableCapture:
        if self._state != "new":
            raise CaptureError("a BreakableCapture can be entered only once")
        if _current() is not None:
            raise CaptureError(
                "a breakable capture is already active in this thread; captures cannot be nested"
            )
        _active.capture = self
        self._state = "capturing"
        self._inference_mode = torch.is_inference_mode_enabled()
        try:
            self._start_audit()
            self._begin_graph()
        except BaseException:
            self._stop_audit()
            _active.capture = None
            self._state = "failed"
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                self._end_graph()
                self._state = "done"
            else:
                self._abort()
        except BaseException:
            self._abort()
            raise
        finally:
            self._stop_audit()
            if _current() is self:
                _active.capture = None

    # -- eager breaks ------------------------------------------------------------------------
    def add_eager(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """End the current graph segment, replay it so that its outputs hold what a replay gives,
        run ``fn`` for real on them, record it, and begin the next graph segment."""
        ended = self._end_graph()
        if ended is not None:
            self._replay_recorded(ended)
        if self._audit is not None:
            self._audit.check_eager_arguments(fn, args, kwargs)
        result = fn(*args, **kwargs)
        self._segments.append(
            EagerSegment(
                fn=fn,
                held_args=tuple(self.backend.hold(a) for a in args),
                held_kwargs={k: self.backend.hold(v) for k, v in kwargs.items()},
            )
        )
        self._begin_graph()
        return result

    # -- replay and introspection -------------------------------------------------------------
    def replay(self) -> None:
        """Run every segment in capture order, in inference mode if it was captured in it."""
        if self._state != "done":
            raise CaptureError(f"cannot replay a capture that is {self._state_words()}")
        if not self._segments:
            raise CaptureError("cannot replay an empty capture: nothing was recorded")
        with torch.inference_mode(self._inference_mode):
            for segment in self._segments:
                segment.replay()

    @property
    def audit_report(self) -> AuditReport:
        """Findings of this capture's audit so far (empty, mode ``"off"``, without an audit)."""
        if self._audit is None:
            return AuditReport(mode=self.audit_mode)
        return self._audit.report()

    @property
    def segments(self) -> tuple[GraphSegment | EagerSegment, ...]:
        return tuple(self._segments)

    @property
    def num_graphs(self) -> int:
        return sum(not isinstance(s, EagerSegment) for s in self._segments)

    @property
    def num_eager_breaks(self) -> int:
        return sum(isinstance(s, EagerSegment) for s in self._segments)

    @property
    def layout(self) -> str:
        """Segment kinds in order, e.g. ``"GEG"`` (G graph, E eager)."""
        return "".join("E" if isinstance(s, EagerSegment) else "G" for s in self._segments)

    def __repr__(self) -> str:
        return (
            f"BreakableCapture(backend={self.backend.name}, full={self.full}, "
            f"state={self._state}, num_graphs={self.num_graphs}, "
            f"num_eager_breaks={self.num_eager_breaks}, layout={self.layout!r})"
        )

    # -- internals ----------------------------------------------------------------------------
    def _start_audit(self) -> None:
        if self.audit_mode == "off":
            return
        audit = CaptureAudit(
            mode=self.audit_mode,
            static=self.static,
            allocations=self._allocations,
        )
        audit.__enter__()
        self._audit = audit

    def _stop_audit(self) -> None:
        """Leave the audit mode (once: the capture is left once; its report stays readable)."""
        if self._audit is not None:
            self._audit.__exit__(None, None, None)

    def _set_recording(self, on: bool) -> None:
        self._recording = on
        if self._audit is not None:
            self._audit.capturing = on

    def _begin_graph(self) -> None:
        self.backend.begin_segment()
        self._set_recording(True)

    def _end_graph(self) -> GraphSegment | None:
        self._set_recording(False)
        segment = self.backend.end_segment()
        if segment is not None:
            self._segments.append(segment)
        return segment

    def _replay_recorded(self, segment: GraphSegment) -> None:
        """Run a just-recorded segment once, unseen by the audit, so that the eager break after
        it reads what every replay will give it instead of what recording left (junk)."""
        with _disable_current_modes(), torch.inference_mode(self._inference_mode):
            segment.replay()

    def _abort(self) -> None:
        if self._recording:
            self._set_recording(False)
            self.backend.abort_segment()
        self._segments.clear()
        self._state = "failed"

    def _state_words(self) -> str:
        return {
            "new": "not yet captured",
            "capturing": "still capturing",
            "failed": "failed (it raised while capturing)",
        }.get(self._state, self._state)
