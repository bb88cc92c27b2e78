"""Checking a candidate plan against the op it would replay: bit for bit, on the capture's values.

``graphs.tape.planning`` offers only candidates that compute the op's function by construction;
the check here catches what construction cannot promise (another kernel, another rounding, other
strides) before a candidate is used.

Invariant: a check never writes memory the program can see. A candidate for an op's fresh
outputs runs into scratch tensors; a ``Tensor`` method standing for an in-place op runs on
copies of the mutated tensors taken before the op ran (``inplace_copies``).
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Sequence
from typing import Any

import torch

from graphs._ops import arguments, op_name
from graphs.tape.steps import Call, Plan

__all__ = [
    "bitwise_equal",
    "call_matches",
    "inplace_copies",
    "mutated_tensors",
    "reproduces",
]

_VALIDATE_INPLACE_MAX_BYTES = 16 << 20
"""In-place ops mutating more than this are replayed through the operator without trying the
faster ``Tensor`` method, because checking the method needs a copy of every mutated tensor."""


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bits (NaN payloads and ±0 too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(as_int), b.view(as_int)
    return bool(torch.equal(a, b))


def _runs(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], outs: Sequence[Any]) -> bool:
    """Build ``plan`` and run its step once, silently; false if it raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan.build(args, kwargs, outs)()
    except (RuntimeError, TypeError, ValueError, IndexError):
        return False
    return True


def reproduces(
    plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], outs: Sequence[torch.Tensor]
) -> bool:
    """Run ``plan`` into scratch outputs; true when it reproduces ``outs`` bit for bit."""
    scratch = [
        torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device=o.device) for o in outs
    ]
    return _runs(plan, args, kwargs, scratch) and all(
        s.stride() == o.stride() and bitwise_equal(s, o) for s, o in zip(scratch, outs, strict=True)
    )


def call_matches(
    plan: Call, args: tuple[Any, ...], kwargs: dict[str, Any], before: dict[int, torch.Tensor]
) -> bool:
    """True when ``plan`` run on the pre-op copies ends with the same bits as the op did."""
    swapped_args = tuple(before.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
    swapped_kwargs = {
        k: before.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
    }
    originals = {id(a): a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    return _runs(plan, swapped_args, swapped_kwargs, ()) and all(
        bitwise_equal(copy, originals[key]) for key, copy in before.items()
    )


def inplace_copies(
    func: torch._ops.OpOverload,
    mutated: Sequence[torch.Tensor],
    key: tuple[Any, ...] | None,
    known: Container[tuple[Any, ...]],
) -> dict[int, torch.Tensor]:
    """Copies of ``mutated`` (``mutated_tensors`` of the call), to check the ``Tensor`` method
    path against (none if the call's signature ``key`` is ``known``: its plan was chosen before)."""
    name = op_name(func)
    if not name.endswith("_") or not hasattr(torch.Tensor, name):
        return {}
    if key is not None and key in known:
        return {}
    if sum(t.untyped_storage().nbytes() for t in mutated) > _VALIDATE_INPLACE_MAX_BYTES:
        return {}
    return {id(t): t.clone(memory_format=torch.preserve_format) for t in mutated}


def mutated_tensors(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensor arguments ``func``'s schema marks as written (``Tensor(a!)``), as passed."""
    return [
        value
        for value, written in arguments(func, args, kwargs)
        if written and isinstance(value, torch.Tensor)
    ]
