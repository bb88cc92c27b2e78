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
  replay even if mutated later). See ``graphs.tape_ops`` for how each replay call is chosen.
- Replay is straight-line: the segment is compiled, when it ends, into a list of zero-argument
  callables; replay calls them in order under inference mode and does nothing else.
- Illegal ops (host syncs, data-dependent shapes, random ops) raise ``CaptureError`` while
  recording (``graphs.legality``); the tape never silently freezes them. Host reads a dispatch
  mode cannot see (``.tolist()``, ``.numpy()``, ``data_ptr()``) must go in an eager break.
- Memory: intermediates the program dropped before the segment ended are re-homed into the
  backend's shared arena (``graphs.tape_memory``); the tape keeps alive only what the program
  still holds, the arena, and copies of literals. ``TapeSegment.memory`` reports the bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphs._tensor_refs import TensorRef, WeakStorage, alias, same_view, storage_key
from graphs.errors import CaptureError
from graphs.legality import check_capturable
from graphs.tape_memory import Lifetime, SegmentMemory, TapePool, plan_offsets
from graphs.tape_ops import (
    Const,
    Plan,
    inplace_copies,
    plan_factory,
    plan_functional,
    plan_mutating,
)

__all__ = ["TapeBackend", "TapeSegment"]

_LITERALS = frozenset({"lift_fresh", "lift", "lift_fresh_copy"})
_FACTORY_PREFIXES = ("new_",)
_FACTORY_SUFFIXES = ("_like",)


def _is_factory(name: str, tensors: list[torch.Tensor]) -> bool:
    """Outputs independent of any tensor's data: no tensor inputs, or ``*_like`` / ``new_*``."""
    return not tensors or name.startswith(_FACTORY_PREFIXES) or name.endswith(_FACTORY_SUFFIXES)


class _StorageInfo:
    """A storage allocated inside the recording segment."""

    __slots__ = ("device", "first", "last", "nbytes", "weak")

    def __init__(self, storage: torch.UntypedStorage, first: int) -> None:
        self.weak = WeakStorage(storage)
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.first = first
        self.last = first


class _Record:
    __slots__ = ("leaves", "outs", "plan", "spec")

    def __init__(self, plan: Plan, leaves: list[Any], spec: Any, outs: list[TensorRef]) -> None:
        self.plan, self.leaves, self.spec, self.outs = plan, leaves, spec, outs


class _Recorder(TorchDispatchMode):
    """The dispatch mode active while a segment records; builds the tape op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[_Record] = []
        self.storages: dict[int, _StorageInfo] = {}
        self.num_ops = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_capturable(func, args, kwargs)
        name = func._schema.name.split("::")[-1]
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        mutating = func._schema.is_mutable
        inplace_view = torch.Tag.inplace_view in func.tags
        with _disable_current_modes():
            before = inplace_copies(func, args, kwargs) if mutating and not inplace_view else {}
        result = func(*args, **kwargs)
        self.num_ops += 1
        outs = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
        index = len(self.records)
        input_keys = {storage_key(t) for t in tensors}
        if name in _LITERALS:
            fresh: tuple[int, ...] = (0,)
        else:
            fresh = tuple(i for i, o in enumerate(outs) if storage_key(o) not in input_keys)
        for i in fresh:
            self._allocated(outs[i], index)
        if inplace_view or (not mutating and len(fresh) == 0):
            return result  # a view: nothing to replay, later uses snapshot its metadata
        with _disable_current_modes():
            plan = self._plan(func, name, args, kwargs, tensors, outs, fresh, before, mutating)
        if plan is not None:
            self.records.append(
                _Record(
                    plan,
                    [self._ref(x, index) for x in leaves],
                    spec,
                    [self._ref(o, index) for o in outs],
                )
            )
        return result

    def _plan(
        self,
        func: torch._ops.OpOverload,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        outs: list[torch.Tensor],
        fresh: tuple[int, ...],
        before: dict[int, torch.Tensor],
        mutating: bool,
    ) -> Plan | None:
        if name in _LITERALS:
            return Const(outs[0].clone())
        if mutating:
            return plan_mutating(func, args, kwargs, outs, fresh, before)
        if _is_factory(name, tensors) and len(outs) == 1:
            return plan_factory(func, args, kwargs, outs[0])
        return plan_functional(func, args, kwargs, outs, fresh)

    def _allocated(self, t: torch.Tensor, index: int) -> None:
        key = storage_key(t)
        if key not in self.storages:
            self.storages[key] = _StorageInfo(t.untyped_storage(), index)

    def _ref(self, x: Any, index: int) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        info = self.storages.get(storage_key(x))
        if info is None:
            return TensorRef(x, weak=False)
        info.last = index
        info.nbytes = max(info.nbytes, x.untyped_storage().nbytes())
        return TensorRef(x, weak=True)


class TapeSegment:
    """A compiled stretch of the tape: ``replay`` calls its steps in order."""

    def __init__(self, steps: list[Any], memory: SegmentMemory, num_ops: int) -> None:
        self._steps = tuple(steps)
        self.memory = memory
        self.num_ops = num_ops

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


class _Compiler:
    """Turns a finished recording into steps, re-homing internal storages into the arena."""

    def __init__(self, recorder: _Recorder, pool: TapePool) -> None:
        self.recorder = recorder
        internal = [
            Lifetime(key=key, nbytes=info.nbytes, first=info.first, last=info.last)
            for key, info in recorder.storages.items()
            if info.weak.expired()
        ]
        self.homes: dict[int, tuple[torch.UntypedStorage, int]] = {}
        arena_bytes = 0
        for device in {recorder.storages[b.key].device for b in internal}:
            blocks = [b for b in internal if recorder.storages[b.key].device == device]
            offsets, total = plan_offsets(blocks)
            arena = pool.arena(device, total)
            arena_bytes += total
            self.homes.update({key: (arena, offset) for key, offset in offsets.items()})
        self.memory = SegmentMemory(
            arena_bytes=arena_bytes,
            internal_bytes=sum(b.nbytes for b in internal),
            retained_bytes=sum(
                info.nbytes for key, info in recorder.storages.items() if key not in self.homes
            ),
            constant_bytes=sum(
                r.plan.saved.untyped_storage().nbytes()
                for r in recorder.records
                if isinstance(r.plan, Const)
            ),
        )
        self._aliases: dict[tuple[Any, ...], torch.Tensor] = {}

    def resolve(self, ref: Any) -> Any:
        """The tensor replay must use for a recorded reference (other leaves pass through)."""
        if not isinstance(ref, TensorRef):
            return ref
        home = self.homes.get(ref.key)
        if home is None:
            t = ref.tensor()
            if t is not None and same_view(t, ref):
                return t
        cache_key = (ref.key, ref.dtype, ref.offset, ref.size, ref.stride)
        cached = self._aliases.get(cache_key)
        if cached is None:
            cached = self._alias(ref, home)
            self._aliases[cache_key] = cached
        return cached

    def _alias(self, ref: TensorRef, home: tuple[torch.UntypedStorage, int] | None) -> torch.Tensor:
        itemsize = torch.empty((), dtype=ref.dtype).element_size()
        if home is not None:
            arena, byte_offset = home
            return alias(
                arena, ref.dtype, byte_offset // itemsize + ref.offset, ref.size, ref.stride
            )
        t = ref.tensor()
        storage: torch.UntypedStorage | None = None
        if t is not None and storage_key(t) == ref.key:
            storage = t.untyped_storage()
        elif ref.key in self.recorder.storages:
            storage = self.recorder.storages[ref.key].weak.get()
        if storage is None:
            raise CaptureError("a tensor recorded by the tape lost its storage before replay")
        return alias(storage, ref.dtype, ref.offset, ref.size, ref.stride)

    def steps(self) -> list[Any]:
        steps = []
        for record in self.recorder.records:
            args, kwargs = tree_unflatten([self.resolve(x) for x in record.leaves], record.spec)
            outs = [self.resolve(o) for o in record.outs]
            steps.append(record.plan.build(args, kwargs, outs))
        return steps


class TapeBackend:
    """Graph backend for the CPU: records ATen ops under a dispatch mode, replays them in order.

    One backend may record many segments and captures; they share one arena (``pool``), so
    segments of one backend must not be replayed concurrently.
    """

    name = "tape"

    def __init__(self, *, pool: TapePool | None = None) -> None:
        self._pool = pool if pool is not None else TapePool()
        self._recorder: _Recorder | None = None

    @property
    def pool(self) -> TapePool:
        return self._pool

    def begin_segment(self) -> None:
        if self._recorder is not None:
            raise CaptureError("the tape is already recording a segment; end it first")
        recorder = _Recorder()
        recorder.__enter__()
        self._recorder = recorder

    def end_segment(self) -> TapeSegment | None:
        recorder = self._stop()
        if recorder.num_ops == 0:
            return None
        with _disable_current_modes(), torch.inference_mode():
            compiler = _Compiler(recorder, self._pool)
            steps = compiler.steps()
        return TapeSegment(steps, compiler.memory, recorder.num_ops)

    def abort_segment(self) -> None:
        with contextlib.suppress(CaptureError):
            self._stop()

    def hold(self, value: Any) -> Any:
        return value

    def release(self, held: Any) -> Any:
        return held

    def _stop(self) -> _Recorder:
        recorder = self._recorder
        if recorder is None:
            raise CaptureError("the tape is not recording a segment")
        self._recorder = None
        recorder.__exit__(None, None, None)
        return recorder

    def __repr__(self) -> str:
        return f"TapeBackend(recording={self._recorder is not None}, pool={self._pool!r})"
