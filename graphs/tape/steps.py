"""Replay plans: what one recorded op becomes on replay, as a zero-argument step.

A plan is chosen once per op while recording (``graphs.tape.planning`` tries them fastest first)
and built into a step when the segment ends, with every recorded tensor resolved to the tensor
replay must use; replay then calls the steps in order and does nothing else.

``CallOut`` and ``Call`` may pass one Python-number operand of an arithmetic op as a 0-dim tensor
of the dtype the op computes in (``number_operand``): ATen converts a number operand to that
dtype on every call (a ``_to_copy`` costing more than the arithmetic at decode sizes); the
kernel then sees the same CPU-scalar operand with the same value, so the result is the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from graphs._tensor_refs import tensors_of

__all__ = [
    "Bound",
    "Call",
    "CallCopy",
    "CallOut",
    "Const",
    "CopyFrom",
    "Fill",
    "Plan",
    "Step",
    "SumThenDivide",
]

Step = Callable[[], object]


# -- plans ------------------------------------------------------------------------------------
# A plan's ``build`` receives the op's arguments and outputs with every recorded tensor resolved
# to the tensor replay must use, and returns the replay step (``None``: nothing to replay).
Args = Sequence[Any]
Outs = Sequence[torch.Tensor]


def number_as_tensor(args: Sequence[Any], index: int, dtype: torch.dtype) -> list[Any]:
    """``args`` with the Python number at ``index`` as a 0-dim CPU tensor of ``dtype`` (ATen
    treats a 0-dim CPU tensor operand as a CPU scalar, on every device)."""
    converted = list(args)
    converted[index] = torch.tensor(args[index], dtype=dtype)
    return converted


@attrs.frozen
class Call:
    """Re-run ``fn(*args, **kwargs)`` as recorded (in-place and user ``out=`` ops).

    ``number_operand``: index of a number argument passed as a 0-dim tensor of the dtype of the
    tensor the op writes (``args[0]``)."""

    fn: Callable[..., Any]
    number_operand: int | None = None

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        if self.number_operand is not None:
            args = number_as_tensor(args, self.number_operand, args[0].dtype)
        return functools.partial(self.fn, *args, **kwargs)


@attrs.frozen
class CallOut(Call):
    """A ``Call`` of an ``out=`` form, writing the captured outputs: ``out_names`` ``None`` means
    the public ``out=`` keyword. Its ``number_operand`` takes ``args[0]``'s dtype, which is the
    output's (``planning`` passes a number as a tensor only where the two agree)."""

    out_names: tuple[str, ...] | None = attrs.field(kw_only=True)

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        return functools.partial(super().build(args, kwargs, outs), **self._out_kwargs(outs))

    def _out_kwargs(self, outs: Sequence[torch.Tensor]) -> dict[str, Any]:
        if self.out_names is None:
            return {"out": outs[0] if len(outs) == 1 else tuple(outs)}
        return dict(zip(self.out_names, outs, strict=True))


@attrs.frozen
class SumThenDivide:
    """``mean`` as ATen's CPU kernel computes it for dtypes that compute in their own precision:
    ``sum`` into the output, then an in-place division by the element count — here passed as a
    0-dim tensor, so the count is not converted on every call (ATen passes it as a number)."""

    count: int

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        out = outs[0]
        summed = functools.partial(torch.sum, *args, **kwargs, out=out)
        divide = functools.partial(
            torch.Tensor.div_, out, torch.tensor(self.count, dtype=out.dtype)
        )

        def step() -> None:
            summed()
            divide()

        return step


@attrs.frozen
class CallCopy:
    """Run ``fn`` and copy the outputs at ``fresh`` (indices into the flat outputs) into place."""

    fn: Callable[..., Any]
    fresh: tuple[int, ...]

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        fn, targets, fresh = self.fn, [outs[i] for i in self.fresh], self.fresh

        def step() -> None:
            result = fn(*args, **kwargs)
            flat = result if isinstance(result, (tuple, list)) else (result,)
            for target, i in zip(targets, fresh, strict=True):
                target.copy_(flat[i])

        return step


@attrs.frozen
class CopyFrom:
    """``output.copy_(args[leaf])``, the output viewed with the source's shape if needed."""

    leaf: int

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        source = tensors_of((args, kwargs))[self.leaf]
        target = outs[0] if outs[0].shape == source.shape else outs[0].view(source.shape)
        return functools.partial(torch.Tensor.copy_, target, source)


@attrs.frozen
class Fill:
    """``output.fill_(value)`` for a factory whose output is one repeated value."""

    value: bool | int | float | complex

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        return functools.partial(torch.Tensor.fill_, outs[0], self.value)


@attrs.frozen
class Const:
    """``output.copy_(saved)``: a factory or literal restored from a copy taken at capture."""

    saved: torch.Tensor

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        return functools.partial(torch.Tensor.copy_, outs[0], self.saved)


@attrs.frozen
class Bound:
    """The operator's kernel called on the replay tensors' fixed addresses
    (``graphs.bound_kernels``: what a CUDA graph does with every kernel)."""

    bind: Callable[..., Step]

    def build(self, args: Args, kwargs: dict[str, Any], outs: Outs) -> Step:
        return self.bind(*args, **kwargs)


Plan = Call | CallOut | SumThenDivide | CallCopy | CopyFrom | Fill | Const | Bound
