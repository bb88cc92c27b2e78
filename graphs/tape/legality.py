"""What a captured segment may not do: host syncs, data-dependent output shapes, random ops,
tensor literals.

A CUDA graph bakes every host-side value into the graph and cannot run a host sync or allocate
an output whose size depends on device data; random ops replay with the seed they were captured
with; a tensor literal (``torch.tensor([...])``) is a copy from pageable host memory, which CUDA
refuses under stream capture (a 0-dim one is let through: torch makes those of Python scalars,
as in ``x[mask] = 0.0``, where CUDA keeps them on the host and kernels take them by value).
The tape would silently freeze all of these, so it refuses them instead, naming the op and the
user's source line. Eager segments are not checked: they may do anything.

Invariant: ``check_capturable`` raises ``CaptureError`` or returns ``None``; it never runs the op.
Ops that are invisible to a dispatch mode (``.tolist()``, ``.numpy()``, ``data_ptr()``) cannot be
checked here and silently freeze values: wrap host reads in an eager break.
"""

from __future__ import annotations

from typing import Any

import torch

from graphs._ops import LITERALS, op_name
from graphs._source import user_location
from graphs.errors import CaptureError

__all__ = ["JUDGED_WHOLE", "check_capturable"]

_HOST_SYNCS = frozenset(
    {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero_numpy"}
)
"""Ops that hand a tensor's data to the host (``.item()``, ``bool(tensor)``, comparisons)."""

_DATA_DEPENDENT_SHAPES = frozenset({"where", "nonzero", "argwhere", "masked_select"})
"""Ops (beyond those tagged ``dynamic_output_shape``) whose output shape depends on data;
``where`` only in its one-argument form."""

_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"})
_DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
_STORAGE_SWAPS = frozenset({"set_"})

JUDGED_WHOLE = frozenset({"one_hot", "repeat_interleave", *_DROPOUTS})
"""Composite ops judged legal by their arguments as a whole: a recorder must not record them as
their decompositions, which may read the host only to validate (``one_hot`` checks its indices
with ``.item()`` on the CPU; given ``num_classes`` the output does not depend on that read)."""


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


def _arg(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> Any:
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            if position < len(args):
                return args[position]
            return argument.default_value
    return None


def _reason(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    name = op_name(func)
    tags = func.tags
    if name in _INDEXING:
        if _has_bool_index(args):
            return "boolean-mask indexing syncs with the host to count the selected elements"
        return None
    if name in _DROPOUTS:
        train = _arg(func, args, kwargs, "train")
        p = _arg(func, args, kwargs, "p")
        if train is False or p == 0:
            return None
        return "random op: replay would reuse the capture's random numbers"
    if torch.Tag.nondeterministic_seeded in tags:
        return "random op: replay would reuse the capture's random numbers"
    if name in LITERALS:
        literal = args[0] if args else None
        if isinstance(literal, torch.Tensor) and literal.dim() == 0:
            return None  # a Python scalar made a tensor (``x[i] = 0.0``): kernels take it by value
        return (
            "tensor literal: a copy from pageable host memory, illegal under CUDA stream "
            "capture (make the tensor once, outside the capture, and reuse it)"
        )
    if name in _HOST_SYNCS or torch.Tag.data_dependent_output in tags:
        return "host sync: a tensor's value is read on the host (.item(), bool(tensor), ...)"
    if name in _STORAGE_SWAPS:
        return "swapping a tensor's storage cannot be replayed"
    if name == "repeat_interleave" and _arg(func, args, kwargs, "output_size") is not None:
        return None
    if name == "one_hot" and (_arg(func, args, kwargs, "num_classes") or -1) >= 0:
        return None
    if name == "where" and len(args) + len(kwargs) > 1:
        return None
    if torch.Tag.dynamic_output_shape in tags or name in _DATA_DEPENDENT_SHAPES:
        return "data-dependent output shape (syncs with the host to size the output)"
    return None


_BY_ARGUMENTS = _INDEXING | _DROPOUTS | LITERALS | {"repeat_interleave", "one_hot", "where"}
"""Ops whose legality depends on their arguments; every other op's is decided by its overload
alone and cached (``_static_reasons``), since capture checks each of ~1000 ops per graph."""

_static_reasons: dict[torch._ops.OpOverload, str | None] = {}


def check_capturable(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise ``CaptureError`` naming ``func`` and the user's line if it cannot be captured."""
    try:
        reason = _static_reasons[func]
    except KeyError:
        if op_name(func) in _BY_ARGUMENTS:
            reason = _reason(func, args, kwargs)
        else:
            reason = _static_reasons[func] = _reason(func, (), {})
    if reason is not None:
        raise CaptureError(
            f"{func} cannot be captured: {reason}; at {user_location()}. "
            "Move it into an eager break (eager_break_during_capture) or out of the capture."
        )
