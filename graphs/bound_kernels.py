"""Operators whose kernel a graph may call with its tensors' addresses fixed at capture.

A CUDA graph records a kernel launch with its pointers baked in; the CPU tape replays an op by
calling it again, through the dispatcher. For an operator that registers a *binder* here (the
project's native CPU kernels, ``dsv4.native_ops``), the tape instead replays the bound call the
binder returns: the same kernel on the same memory, without the dispatch. The binder is also
the operator's own CPU kernel (``bind(*args)()``), so the two cannot differ.

Invariant: ``bind(*args)`` returns a zero-argument call that runs exactly what the operator
runs on ``args`` and holds every tensor it addresses (so their memory outlives the call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Binder", "BoundCall", "binder_of", "register_binder"]

BoundCall = Callable[[], object]
"""A kernel call with its arguments fixed: what a binder returns and the tape replays."""
Binder = Callable[..., BoundCall]
_BINDERS: dict[torch._ops.OpOverload, Binder] = {}


def register_binder(op: torch._ops.OpOverload, bind: Binder) -> None:
    """Declare ``bind`` the binder of ``op`` (see the module docstring)."""
    _BINDERS[op] = bind


def binder_of(op: Any) -> Binder | None:
    """``op``'s binder, or ``None`` if it registered none."""
    return _BINDERS.get(op)
