"""``TapeBackend``: a CPU graph backend that records ATen ops and replays them like a CUDA graph.

While a segment records, a dispatch mode sees every ATen op the program issues, runs it, and
appends it to a tape. Replay re-runs the tape against the *same tensor objects* with every
Python scalar, shape and list argument frozen as captured — exactly what a CUDA graph bakes in
(fixed addresses, frozen host decisions) — so a program that is wrong under a CUDA graph is
wrong on the tape too, on a CPU.

Invariants:
- Ops are classified by what they do to memory, found by storage (not by schema, which hides
  aliasing in ops such as ``_unsafe_view``): an op whose outputs all alias an input's storage is a
  view and is not replayed (its output already points at the right memory, with frozen view
  metadata); in-place view ops (``transpose_``, ``unsqueeze_``) are not replayed either, since
  every recorded use of a tensor snapshots the view metadata that use saw; ops that write their
  arguments are re-run; ops that produce fresh outputs recompute them into the captured outputs;
  factories and literals are re-filled with their captured value (so they start fresh each
  replay even if mutated later) — unless, when the segment ends, nothing wrote them after their
  creation and nothing but the tape references them: such *constants* are kept and never
  replayed. Composite ops are recorded as the ops eager runs for them
  (``graphs.tape.recording``). See ``graphs.tape.planning`` for how each replay call is chosen.
- Replay is straight-line: the segment is linked, when it ends, into a list of zero-argument
  callables (``graphs.tape.linking``); replay calls them in order under inference mode and does
  nothing else.
- Illegal ops (host syncs, data-dependent shapes, random ops) raise ``CaptureError`` while
  recording (``graphs.tape.legality``); the tape never silently freezes them. Host reads a
  dispatch mode cannot see (``.tolist()``, ``.numpy()``, ``data_ptr()``) must go in an eager
  break.
- Memory: intermediates the program dropped before the segment ended are re-homed into the
  backend's shared arena (``graphs.tape.memory``); the tape keeps alive only what the program
  still holds, the arena, constants and copies of literals. ``TapeSegment.memory`` reports the
  bytes.
- Recording is not execution, as on CUDA (``graphs.tape.stale``): when a segment ends, the
  tensors it produced hold junk and the outside memory it wrote holds its prior bytes, until the
  segment is replayed. This is always on; nothing switches it off.
- A retired pool (all its graphs gone, ``graphs.backend.PoolGraphs``) is never recorded into
  again; a failed segment leaves the backend not recording. A segment that recorded nothing
  keeps its use of the pool as long as the backend lives (as ``CudaGraphBackend`` keeps an
  empty graph), so a capture that begins with an eager break leaves its fresh pool usable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphs.backend import PoolUse
from graphs.errors import CaptureError
from graphs.tape.linking import Linker
from graphs.tape.memory import SegmentMemory, TapePool
from graphs.tape.planning import PlanCache
from graphs.tape.recording import Recorder
from graphs.tape.stale import fill_junk
from graphs.tape.steps import Step

__all__ = ["TapeBackend", "TapeSegment"]


class TapeSegment:
    """A linked stretch of the tape: ``replay`` calls its steps in order."""

    def __init__(
        self, steps: list[Step], memory: SegmentMemory, num_ops: int, use: PoolUse
    ) -> None:
        self._steps = tuple(steps)
        self.memory = memory
        self.num_ops = num_ops
        self._use = use
        """Its use of the pool, given back with the segment."""

    @property
    def num_steps(self) -> int:
        """Calls made per replay (ops that are views or ``empty`` factories make none)."""
        return len(self._steps)

    def replay(self) -> None:
        with torch._C._InferenceMode(True):
            for step in self._steps:
                step()

    def __repr__(self) -> str:
        return f"TapeSegment(num_ops={self.num_ops}, num_steps={self.num_steps})"


class TapeBackend:
    """Graph backend for the CPU: records ATen ops under a dispatch mode, replays them in order.

    One backend may record many segments and captures; they share one arena (``pool``), so
    segments of one backend must not be replayed concurrently.
    """

    name = "tape"

    def __init__(self, *, pool: TapePool | None = None) -> None:
        self._pool = pool if pool is not None else TapePool()
        self._recorder: Recorder | None = None
        self._use: PoolUse | None = None
        """The recording segment's use of the pool (taken at its beginning, as on CUDA)."""
        self._empty_uses: list[PoolUse] = []
        """Uses of segments that recorded nothing, kept as ``CudaGraphBackend`` keeps empty
        graphs: given back, the first one would leave a fresh pool retired."""
        self._plan_cache: PlanCache = {}

    @property
    def pool(self) -> TapePool:
        return self._pool

    def begin_segment(self) -> None:
        if self._recorder is not None:
            raise CaptureError("the tape is already recording a segment; end it first")
        self._pool.graphs.require_recordable()
        recorder = Recorder(self._plan_cache)
        recorder.__enter__()
        self._recorder = recorder
        self._use = self._pool.graphs.take()

    def end_segment(self) -> TapeSegment | None:
        use = self._use
        recorder = self._stop()
        assert use is not None
        with _disable_current_modes(), torch.inference_mode():
            recorder.outside_writes.restore()
            if recorder.num_ops == 0:
                self._empty_uses.append(use)
                return None
            linker = Linker(recorder, self._pool)
            steps = linker.steps()
            for key, info in recorder.storages.items():
                if key in linker.homes or key in linker.constants:
                    continue
                storage = info.weak.get()
                if storage is not None:
                    fill_junk(storage, info.dtype)
        return TapeSegment(steps, linker.memory, recorder.num_ops, use)

    def abort_segment(self) -> None:
        with contextlib.suppress(CaptureError):
            recorder = self._stop()
            with _disable_current_modes():
                recorder.outside_writes.restore()

    def hold(self, value: Any) -> Any:
        return value

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once eagerly, as the CUDA backend does before a capture: the tape itself
        creates nothing lazily, but whatever the step leaves behind for the capture after it
        (a value cached on the first call, a buffer allocated then) must be there on the CPU
        too, for the capture's audit to catch a read of it."""
        fn()

    def _stop(self) -> Recorder:
        recorder = self._recorder
        if recorder is None:
            raise CaptureError("the tape is not recording a segment")
        self._recorder = self._use = None
        recorder.__exit__(None, None, None)
        return recorder

    def __repr__(self) -> str:
        return f"TapeBackend(recording={self._recorder is not None}, pool={self._pool!r})"
