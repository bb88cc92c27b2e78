"""Counting the ATen ops a piece of code dispatches: what its dispatch floor is made of.

Every op costs its caller a dispatch (from Python, argument parsing, the dispatcher, the
kernel's setup) whatever work it does, so ``ops x the cost of an empty op`` is a floor under the
code's time. ``OpCounter`` counts ops as the tape records them: a composite op that eager runs
as its ``CompositeImplicitAutograd`` decomposition on the tensors' device (``linear``,
``einsum``, ``rms_norm`` on a CPU) counts as the ops of that decomposition, views included;
an operator of this project (``torch.library``, such as the hyper-connections' Sinkhorn
rounds) counts as the ATen ops the kernel it reaches on the tensors' device runs (its kernel for
that device, else its composite), and as one op where that kernel runs none (a native kernel);
ops of a replayed tape count as the tape issues them (views and constants it does not replay
are not issued).

Invariant: counting changes nothing the code computes: every op runs as it would without the
counter (a decomposed composite is the very kernel sequence eager runs).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from graphs._ops import QuietDispatchMode, op_name
from graphs._tensor_refs import tensors_of
from graphs.tape.recording import run_decomposed, runs_decomposed

__all__ = ["OpCounter"]

_ATEN = frozenset({"aten", "prims"})
_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd
"""Where an operator of Python code has its implementation for every device (``torch.library``)."""
_BACKEND_KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}


def _kernel_key(
    func: torch._ops.OpOverload, device_type: str | None
) -> torch._C.DispatchKey | None:
    """The key of the kernel ``func`` (an operator outside ATen) reaches on ``device_type``:
    its kernel for that device, else its composite; ``None`` if it has neither (it then
    counts as one op, as ATen's do)."""
    for key in (_BACKEND_KEYS.get(device_type or ""), _COMPOSITE):
        if key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
            return key
    return None


class OpCounter(QuietDispatchMode):
    """A dispatch mode counting the ops issued while it is active, by short name (``by_name``)
    and in all (``total``); it may be entered again and keeps counting."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        tensors = tensors_of((args, kwargs))
        device_type = tensors[0].device.type if tensors else None
        key = None if func.namespace in _ATEN else _kernel_key(func, device_type)
        if key is not None:  # count the ops it runs, or the op itself if it runs none
            before = self.total
            with self:
                result = func._op_dk(key, *args, **kwargs)
            if self.total == before:
                self.by_name[op_name(func)] += 1
            return result
        if tensors and runs_decomposed(func, tensors[0].device.type):
            with self:
                return run_decomposed(func, args, kwargs)
        self.by_name[op_name(func)] += 1
        return func(*args, **kwargs)
