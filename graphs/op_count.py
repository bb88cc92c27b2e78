"""Counting the ATen ops a piece of code dispatches: what its dispatch floor is made of.

Every op costs its caller a dispatch (from Python, argument parsing, the dispatcher, the
kernel's setup) whatever work it does, so ``ops x the cost of an empty op`` is a floor under the
code's time. ``OpCounter`` counts ops as the tape records them: a composite op that eager runs
as its ``CompositeImplicitAutograd`` decomposition on the tensors' device (``linear``,
``einsum``, ``rms_norm`` on a CPU) counts as the ops of that decomposition, views included;
an operator implemented in Python (``torch.library``, such as the hyper-connections'
Sinkhorn rounds) counts as the ops its implementation runs; ops of a replayed tape count as the
tape issues them (views and constants it does not replay are not issued).

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
_PYTHON_OPERATOR = torch._C.DispatchKey.CompositeExplicitAutograd
"""Where an operator of Python code has its implementation (``torch.library``)."""


def _runs_python(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` is an operator with a Python implementation where ``torch.library``
    puts it (other operators count as one op, as ATen's do)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _PYTHON_OPERATOR)


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
        if func.namespace not in _ATEN and _runs_python(func):  # count the ops it runs
            with self:
                return func._op_dk(_PYTHON_OPERATOR, *args, **kwargs)
        tensors = tensors_of((args, kwargs))
        if tensors and runs_decomposed(func, tensors[0].device.type):
            with self:
                return run_decomposed(func, args, kwargs)
        self.by_name[op_name(func)] += 1
        return func(*args, **kwargs)
