"""Recording a tape segment: a dispatch mode that runs each op and notes how to replay it.

For every ATen op issued while a segment records: check it is capturable
(``graphs.tape.legality``), run it, classify it by what it did to memory (found by storage),
choose its replay plan (``graphs.tape.planning``) and keep references to its tensors
(``graphs.tape.refs``): weak ones to tensors allocated in the segment, strong ones to tensors
from outside it.

Invariants:
- An op eager runs as its ``CompositeImplicitAutograd`` decomposition on the tensors' device (no
  kernel of its own there: ``linear``, ``einsum``, ``rms_norm``, ``softmax``) is not recorded;
  the ops of that decomposition are, as eager runs them, so each gets its own ``out=`` plan
  instead of the composite being run and copied on every replay. The result is the same by
  construction: it is the very kernel sequence eager runs.
- Views (every output aliases an input's storage) and in-place view ops are not recorded: their
  outputs already point at the right memory, and each later use snapshots the view metadata.
- ``storages`` holds every storage allocated in the segment, with the first and last record
  index touching it (its lifetime within the segment) and its largest size.
- ``written`` holds every storage a recorded op wrote; ``factory_outputs`` holds factory and
  literal outputs strongly until the segment ends, to decide which of them are constants.
- ``outside_writes`` logs the prior bytes of everything from outside the segment that an op is
  about to write, before it writes, so the segment's end can undo the writes recording made
  (``graphs.tape.stale``: recording is not execution).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from graphs._ops import LITERALS, QuietDispatchMode, is_like_factory, op_name
from graphs._tensor_refs import WeakStorage, storage_key, tensors_of
from graphs.tape.checking import inplace_copies, mutated_tensors
from graphs.tape.legality import JUDGED_WHOLE, check_capturable
from graphs.tape.planning import (
    PlanCache,
    plan_factory,
    plan_functional,
    plan_mutating,
    signature,
)
from graphs.tape.refs import TensorRef, map_leaves
from graphs.tape.stale import OutsideWrites, written_rows
from graphs.tape.steps import Const, Plan

__all__ = ["Record", "Recorder", "StorageInfo", "run_decomposed", "runs_decomposed"]

_BACKEND_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
"""Its C++ kernel, the one eager runs: never a Python decomposition (``OpOverload.decompose``
prefers those, and they need not issue the same ops)."""


def run_decomposed(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``func`` as its ``CompositeImplicitAutograd`` kernel: the ops of its decomposition
    reach the dispatch modes active around the call one by one, as eager issues them."""
    return func._op_dk(_COMPOSITE, *args, **kwargs)


@functools.cache
def runs_decomposed(func: torch._ops.OpOverload, device_type: str) -> bool:
    """True when eager runs ``func`` on ``device_type`` as its ``CompositeImplicitAutograd``
    decomposition (no kernel of its own for the device)."""
    backend = _BACKEND_KEYS.get(device_type)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    name = func.name()
    return (
        backend is not None
        and op_name(func) not in JUDGED_WHOLE
        and has_kernel(name, "CompositeImplicitAutograd")
        and not has_kernel(name, backend)
    )


@functools.cache
def _traits(func: torch._ops.OpOverload) -> tuple[str, bool, bool]:
    """``func``'s short name, whether it mutates, and whether it is an in-place view op: read
    once per overload (schema and tag lookups cost more than many of the ops recorded)."""
    return op_name(func), func._schema.is_mutable, torch.Tag.inplace_view in func.tags


def _is_factory(name: str, tensors: list[torch.Tensor]) -> bool:
    """Outputs independent of any tensor's data: no tensor inputs, or ``*_like`` / ``new_*``."""
    return not tensors or is_like_factory(name)


class StorageInfo:
    """A storage allocated inside the recording segment."""

    __slots__ = ("device", "dtype", "first", "last", "nbytes", "weak")

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype, first: int) -> None:
        self.weak = WeakStorage(storage)
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.dtype = dtype
        """The dtype of the op output that allocated it (what its junk is written as)."""
        self.first = first
        self.last = first


@attrs.define(eq=False)
class Record:
    """One recorded op: its plan, and its arguments and outputs with tensors as ``TensorRef``."""

    plan: Plan
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: list[TensorRef]
    constant_key: int | None
    """Storage key of a factory or literal output (a candidate constant), else ``None``."""


class Recorder(QuietDispatchMode):
    """The dispatch mode active while a segment records; builds the tape op by op."""

    def __init__(self, plan_cache: PlanCache) -> None:
        super().__init__()
        self.plan_cache = plan_cache
        self.records: list[Record] = []
        self.storages: dict[int, StorageInfo] = {}
        self.num_ops = 0
        self.written: set[int] = set()
        self.outside_writes = OutsideWrites()
        self.factory_outputs: dict[int, torch.UntypedStorage] = {}
        """Factory and literal outputs, held until the segment ends to see if they are
        constants: never written after creation and referenced by nothing but the tape."""

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        check_capturable(func, args, kwargs)
        tensors = tensors_of((args, kwargs))
        if tensors and runs_decomposed(func, tensors[0].device.type):
            # Record the ops eager runs for it instead: each gets its own (out=) plan, where the
            # composite op itself has no out= form and would be run and copied. It counts as an
            # op issued (its decomposition may issue none: ``dropout`` in eval returns its input).
            self.num_ops += 1
            with self:
                return run_decomposed(func, args, kwargs)
        name, mutating, inplace_view = _traits(func)
        with torch._C._DisableTorchDispatch():  # no mode sees the checks (cheaper than popping)
            key: tuple[Any, ...] | None = None
            before: dict[int, torch.Tensor] = {}
            mutated: list[torch.Tensor] = []
            if mutating and not inplace_view:
                # a mutating op's plan-cache key, taken once, before the op runs (``None`` when
                # its arguments are unhashable)
                key = signature(func, args, kwargs)
                mutated = mutated_tensors(func, args, kwargs)
                before = inplace_copies(func, mutated, key, self.plan_cache)
                rows = written_rows(func, args, kwargs)
                for t in mutated:
                    if storage_key(t) not in self.storages:
                        self.outside_writes.save(t, rows)
        result = func(*args, **kwargs)
        self.num_ops += 1
        outs = tensors_of(result)
        index = len(self.records)
        input_keys = {storage_key(t) for t in tensors}
        if name in LITERALS:
            fresh: tuple[int, ...] = (0,)
        else:
            fresh = tuple(i for i, o in enumerate(outs) if storage_key(o) not in input_keys)
        for i in fresh:
            self._allocated(outs[i], index)
        if inplace_view or (not mutating and len(fresh) == 0):
            return result  # a view: nothing to replay, later uses snapshot its metadata
        if mutating:
            self.written.update(storage_key(t) for t in mutated)
        with torch._C._DisableTorchDispatch():  # no mode sees the checks (cheaper than popping)
            plan: Plan | None
            if name in LITERALS:
                plan = Const(outs[0].clone())
            elif mutating:
                plan = plan_mutating(func, args, kwargs, outs, fresh, before, key, self.plan_cache)
            elif _is_factory(name, tensors) and len(outs) == 1:
                plan = plan_factory(func, args, kwargs, outs[0])
            else:
                plan = plan_functional(func, args, kwargs, outs, fresh, self.plan_cache)
        if plan is not None:
            constant_key = None
            if name in LITERALS or (not mutating and _is_factory(name, tensors)):
                constant_key = storage_key(outs[0])
                self.factory_outputs[constant_key] = outs[0].untyped_storage()
            ref = functools.partial(self._ref, index=index)
            self.records.append(
                Record(
                    plan,
                    map_leaves(ref, args, torch.Tensor),
                    map_leaves(ref, kwargs, torch.Tensor),
                    [ref(o) for o in outs],
                    constant_key,
                )
            )
        return result

    def _allocated(self, t: torch.Tensor, index: int) -> None:
        key = storage_key(t)
        if key not in self.storages:
            self.storages[key] = StorageInfo(t.untyped_storage(), t.dtype, index)

    def _ref(self, x: torch.Tensor, index: int) -> TensorRef:
        key = storage_key(x)
        info = self.storages.get(key)
        if info is None:
            return TensorRef(x, weak=False, key=key)
        info.last = index
        info.nbytes = max(info.nbytes, x.untyped_storage().nbytes())
        return TensorRef(x, weak=True, key=key)
