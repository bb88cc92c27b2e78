"""Value checks of quantized tensors at load (``dsv4.quantized_loading``), the quantized
counterpart of ``dsv4.checkpoint``'s ``isfinite`` pass, and filling a parameter with the values.

A quantized weight is refused with a one-line ``TensorValueError`` naming the tensor as its
file names it and the file when a scale is NaN or infinite (float32 NaN/inf, ue8m0 byte 255),
when FP8 data holds an ``e4m3fn`` NaN code (``0x7F``/``0xFF``; MXFP4 has none), or when a
value overflows the compute dtype, checked in that order. The overflow check dequantizes only
where it can happen (the largest scale times the format's largest magnitude exceeds the dtype's
range), so weight-only loading does not dequantize every tensor.

Memory: every pass walks the tensor in row blocks of at most ``max_values`` values
(``QuantizedTensor.chunks``), so its temporaries are bounded by the block, never the tensor;
counts and the first bad index are those of the whole tensor. ``dequantize_into`` writes each
block's float32 product straight into its rows of the parameter (the one cast is the copy), so
the values are bit-identical to ``QuantizedTensor.dequantize`` and no full-size copy exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dsv4.errors import TensorValueError
from dsv4.quant_formats import FP4_VALUES, FP8_MAX, QuantizedTensor, scale_to_float32
from dsv4.shard_reader import Stored

__all__ = ["Pair", "Stored", "check_values", "dequantize_into"]

Pair = tuple[Stored, Stored | None]
"""A quantized weight and its scale (``None``: missing, which decoding reports)."""


def _scan(
    qt: QuantizedTensor, max_values: int, bad_of: Callable[[QuantizedTensor], torch.Tensor]
) -> tuple[str, list[int], float] | None:
    """``None`` when ``bad_of`` marks nothing in any block of ``qt``, else the count (``"N of
    M"``), the first marked index and the float32 value there."""
    count = 0
    first: tuple[list[int], float] | None = None
    for index, part in qt.chunks(max_values):
        bad = bad_of(part)
        if not bool(bad.any()):
            continue
        marked = int(bad.sum())
        if first is None:
            local = bad.nonzero()[0].tolist()
            prefix = [i for i in index if isinstance(i, int)]
            start = index[-1].start if isinstance(index[-1], slice) else 0
            was = float(part.dequantize(torch.float32)[tuple(local)])
            first = ([*prefix, start + local[0], *local[1:]], was)
        count += marked
    if first is None:
        return None
    return f"{count} of {math.prod(qt.shape)}", *first


def check_values(qt: QuantizedTensor, dtype: torch.dtype, pair: Pair, *, max_values: int) -> None:
    """Refuse non-finite scales, NaN codes, and values that overflow ``dtype`` (see the module
    docstring)."""
    weight, scale = pair
    assert scale is not None  # decode_weight refuses a quantized weight without its scale
    factors = scale_to_float32(qt.scale)
    bad = ~torch.isfinite(factors)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise TensorValueError(
            scale.key,
            scale.path.name,
            f"has non-finite scales (NaN or inf): {int(bad.sum())} of {bad.numel()}, the first "
            f"{float(factors[tuple(first)])} at index {first}; the weights are corrupt",
        )
    if qt.format == "fp8":
        codes = _scan(qt, max_values, lambda part: (part.data.view(torch.uint8) & 0x7F) == 0x7F)
        if codes is not None:
            raise TensorValueError(
                weight.key,
                weight.path.name,
                f"has NaN codes: {codes[0]}, the first at index {codes[1]}; the weights are "
                "corrupt",
            )
    largest = FP8_MAX if qt.format == "fp8" else max(FP4_VALUES)
    if float(factors.abs().max()) * largest <= torch.finfo(dtype).max:
        return
    over = _scan(qt, max_values, lambda part: ~torch.isfinite(part.dequantize(dtype)))
    if over is not None:
        count, first, was = over
        raise TensorValueError(
            weight.key,
            weight.path.name,
            f"has values that overflow {str(dtype).removeprefix('torch.')}: {count}, the first "
            f"{was:g} at index {first}; load it in float32 or bfloat16",
        )


def dequantize_into(
    qt: QuantizedTensor, target: torch.Tensor, pair: Pair, *, max_values: int
) -> None:
    """Check ``qt`` for ``target``'s dtype, then write its values into ``target`` (its shape)
    block by block: each block's float32 product, cast once by the copy."""
    check_values(qt, target.dtype, pair, max_values=max_values)
    for index, part in qt.chunks(max_values):
        target[index].copy_(part.dequantize(torch.float32))
