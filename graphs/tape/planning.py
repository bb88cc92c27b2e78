"""Choosing how the tape replays one op: the fastest plan that is bitwise-equal to the op.

While recording, each op gets a plan (``graphs.tape.steps``). The candidates, fastest first:

- ``CopyFrom``: copy-like ops (``clone``, ``_to_copy``, a copying ``reshape``, ...) become one
  ``Tensor.copy_`` into the captured output.
- ``Fill`` / ``Const``: factories (outputs independent of any tensor's data) are re-filled in
  place with their captured value, so a factory output mutated later starts fresh every replay.
- ``CallOut``: a public ``torch.*(…, out=)`` function of the same name, else the overload
  ``graphs.tape.out_variants.out_variant`` finds by schema (a naive ``.out`` lookup is wrong
  for ``pow``, ``le``, ``where``, ``softmax.int``, ``index``).
- ``Call``: in-place and user ``out=`` ops re-run as recorded (the public ``Tensor`` method when
  it was checked to match, the operator otherwise); an operator with a binder
  (``graphs.bound_kernels``) replays as ``Bound``, its own kernel on fixed addresses.
- ``CallCopy``: the fallback for everything else: run the op, copy its fresh outputs into place.

Two rewrites come before the public forms, for dtypes whose arithmetic computes in the dtype
itself (fp32, fp64, int32, int64): a CPU ``mean`` tries ``SumThenDivide`` (the kernel sequence
ATen's own CPU ``mean`` runs, minus its per-call conversion of the count), and arithmetic with a
Python-number operand (``x * 2``, ``x.add_(eps)``) tries the same call with the number passed as
a 0-dim tensor of that dtype (``number_operand``; see ``_number_operand``).

Invariant: a candidate is used only if it computes the same function as the op by construction
(same operator name, or a copy for a copy-like op, or a fill for a data-independent factory, or
one of the two rewrites, each ATen's own definition of the op) *and* reproduced the op's
capture-time result bit for bit (``graphs.tape.checking``); otherwise the next one is tried. One
sample cannot prove two different functions equal, which is why candidates are never arbitrary.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from graphs._ops import op_name
from graphs._tensor_refs import tensors_of
from graphs.bound_kernels import binder_of
from graphs.tape.checking import call_matches, reproduces
from graphs.tape.out_variants import out_names, out_variant
from graphs.tape.steps import (
    Bound,
    Call,
    CallCopy,
    CallOut,
    Const,
    CopyFrom,
    Fill,
    Plan,
    SumThenDivide,
)

__all__ = ["PlanCache", "plan_factory", "plan_functional", "plan_mutating", "signature"]

PlanCache = dict[tuple[Any, ...], "Plan"]
"""The plan that won, by op signature; kept by a backend across its segments. Only plans that
hold no tensors are cached (every plan these functions choose but ``Const``).

Whether a candidate reproduces an op bit for bit depends on the kernels it reaches, which
depend on the op, the scalar arguments and the tensors' dtypes, devices, shapes and strides —
not on the values. So an op seen again with the same signature (the next layer, the next
capture) takes the same plan without being run twice."""

_COPY_LIKE = frozenset(
    {"clone", "_to_copy", "to", "contiguous", "reshape", "flatten", "_reshape_copy", "view_copy"}
)
_PUBLIC_NAMESPACES: tuple[Any, ...] = (
    torch,
    *(getattr(torch._C, name) for name in ("_nn", "_linalg", "_special", "_fft")),
)
_NUMBER_OPERAND_OPS = frozenset(
    {"add", "sub", "mul", "div", "remainder", "floor_divide"}
    | {"add_", "sub_", "mul_", "div_", "remainder_", "floor_divide_"}
)
"""Ops whose number overload is the tensor overload on ``wrapped_scalar_tensor(number)``."""
_OWN_PRECISION = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
"""Dtypes binary arithmetic computes in (its ``opmath`` type is the dtype itself): ATen
converts a number operand to exactly this dtype, so a 0-dim tensor of it is the same operand.
(Reduced floats compute in fp32 and read the number unrounded, so they are left out.)"""


def _op_callable(func: torch._ops.OpOverload) -> Callable[..., Any]:
    """The operator's C++ entry point (skips the Python ``OpOverload.__call__`` frame)."""
    return getattr(func, "_op", func)


def _dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill a block of memory exactly once (any dimension order)."""
    if t.is_contiguous() and t.numel() > 0:
        return True  # the common case, decided in C++ (an empty tensor takes the walk below)
    expected = 1
    for stride, size in sorted(
        [(st, sz) for st, sz in zip(t.stride(), t.size(), strict=True) if sz != 1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


# -- choosing a plan ----------------------------------------------------------------------------


def _mean_count(name: str, args: tuple[Any, ...], outs: Sequence[torch.Tensor]) -> int | None:
    """Elements averaged per output of a CPU ``mean`` in a dtype that computes in its own
    precision (where ATen's kernel is ``sum`` then a division by this count); else ``None``."""
    if name != "mean" or len(outs) != 1 or not args or not isinstance(args[0], torch.Tensor):
        return None
    source, out = args[0], outs[0]
    floating_own_precision = out.dtype in (torch.float32, torch.float64)
    if out.device.type != "cpu" or out.dtype != source.dtype or not floating_own_precision:
        return None
    return source.numel() // out.numel() if out.numel() else None


def _number_operand(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> int | None:
    """Index of a Python-number operand of an op in ``_NUMBER_OPERAND_OPS`` that ATen would
    convert to ``dtype`` on every call, where ``dtype`` is both the tensor operand's and the
    result's and computes in its own precision; else ``None``."""
    if name not in _NUMBER_OPERAND_OPS or "rounding_mode" in kwargs or len(args) < 2:
        return None
    tensor, number = args[0], args[1]
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype:
        return None
    if dtype not in _OWN_PRECISION or isinstance(number, bool):
        return None
    if (isinstance(number, float) and dtype.is_floating_point) or isinstance(number, int):
        return 1
    return None


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            value.dtype,
            value.device,
            tuple(value.size()),
            tuple(value.stride()),
            value.storage_offset(),
        )
    if isinstance(value, (list, tuple)):
        return tuple([_meta(v) for v in value])
    if isinstance(value, dict):
        return tuple([(k, _meta(v)) for k, v in sorted(value.items())])
    return (type(value), value)


def signature(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: Sequence[torch.Tensor] = (),
) -> tuple[Any, ...] | None:
    """The key of ``PlanCache`` for this call, or ``None`` if an argument is unhashable."""
    key = (func, _meta(args), _meta(kwargs), _meta(tuple(outs)))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _public_function(name: str) -> Callable[..., Any] | None:
    for namespace in _PUBLIC_NAMESPACES:
        fn = getattr(namespace, name, None)
        if isinstance(fn, types.BuiltinFunctionType):
            return fn
    return None


@functools.cache
def _out_candidates(func: torch._ops.OpOverload) -> tuple[CallOut, ...]:
    """The ``out=`` forms of ``func``: the public function of its name, then its out overload.

    Cached per operator: it depends on nothing else, and ``out_variant`` scans overloads."""
    name = op_name(func)
    candidates: list[CallOut] = []
    public = _public_function(name)
    if public is not None:
        candidates.append(CallOut(public, out_names=None))
    out_op = out_variant(func)
    if out_op is not None:
        candidates.append(CallOut(_op_callable(out_op), out_names=out_names(out_op)))
    return tuple(candidates)


def plan_functional(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: Sequence[torch.Tensor],
    fresh: tuple[int, ...],
    cache: PlanCache,
) -> Plan:
    """Plan for an op that reads its inputs and writes fresh outputs (indices ``fresh``)."""
    fallback = CallCopy(_op_callable(func), fresh)
    if len(fresh) != len(outs) or not all(map(_dense, outs)):
        return fallback
    key = signature(func, args, kwargs, outs)
    if key is not None and key in cache:
        return cache[key]  # the same outputs are all fresh, so even a fallback is the same
    name = op_name(func)
    candidates: list[Plan] = []
    sources = tensors_of((args, kwargs))
    copy_like = name in _COPY_LIKE and len(outs) == 1 and len(sources) == 1
    if copy_like and sources[0].numel() == outs[0].numel():
        candidates.append(CopyFrom(0))
    mean_count = _mean_count(name, args, outs)
    if mean_count is not None:
        candidates.append(SumThenDivide(mean_count))
    out_candidates = _out_candidates(func)
    number = _number_operand(name, args, kwargs, outs[0].dtype)
    if number is not None:
        candidates.extend(attrs.evolve(c, number_operand=number) for c in out_candidates)
    candidates.extend(out_candidates)
    plan = next((c for c in candidates if reproduces(c, args, kwargs, outs)), fallback)
    if key is not None:
        cache[key] = plan
    return plan


def plan_factory(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: torch.Tensor,
) -> Plan | None:
    """Plan for an op whose output does not depend on any tensor's data; ``None``: skip it.

    ``empty``-like outputs hold undefined values and are not re-filled.
    """
    name = op_name(func)
    if "empty" in name or out.numel() == 0:
        return None
    first = out.reshape(-1)[0]
    if bool((out == first).all()) and reproduces(Fill(first.item()), args, kwargs, [out]):
        return Fill(first.item())
    if _dense(out):
        for candidate in _out_candidates(func):
            if reproduces(candidate, args, kwargs, [out]):
                return candidate
    return Const(out.clone())


def plan_mutating(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: Sequence[torch.Tensor],
    fresh: tuple[int, ...],
    before: dict[int, torch.Tensor],
    key: tuple[Any, ...] | None,
    cache: PlanCache,
) -> Plan:
    """Plan for an op that writes some of its arguments (in-place or user ``out=``).

    ``key`` is the op's ``signature`` without outputs (computed once for ``inplace_copies``
    too). ``before`` maps ``id`` of each mutated argument to a copy taken before the op ran
    (empty when the mutated tensors were too large to copy, or when ``cache`` already knows the
    op's signature — see ``inplace_copies``); with it the public ``Tensor`` method (first with a
    number operand as a tensor, where eligible) is checked against the op on the copies.
    """
    op = _op_callable(func)
    if fresh:
        return CallCopy(op, fresh)
    bind = binder_of(func)
    if bind is not None:  # its own CPU kernel, bound: the same function by construction
        return Bound(bind)
    if key is not None and key in cache:
        return cache[key]
    name = op_name(func)
    method = getattr(torch.Tensor, name, None) if name.endswith("_") else None
    if method is None or not before:
        return Call(op)
    candidates: list[Call] = []
    written = args[0] if args and isinstance(args[0], torch.Tensor) else None
    number = None if written is None else _number_operand(name, args, kwargs, written.dtype)
    if number is not None:
        candidates.append(Call(method, number))
    candidates.append(Call(method))
    plan = next((c for c in candidates if call_matches(c, args, kwargs, before)), Call(op))
    if key is not None:
        cache[key] = plan
    return plan
