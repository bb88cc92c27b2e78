"""Value checks of quantized tensors at load (``dsv4.quantized_loading``), the quantized
counterpart of ``dsv4.checkpoint``'s ``isfinite`` pass.

A quantized weight is refused with a one-line ``TensorValueError`` naming the tensor as its
file names it and the file when a scale is NaN or infinite (float32 NaN/inf, ue8m0 byte 255),
when FP8 data holds an ``e4m3fn`` NaN code (``0x7F``/``0xFF``; MXFP4 has none), or when a
value overflows the compute dtype. The overflow check dequantizes only where it can happen
(the largest scale times the format's largest magnitude exceeds the dtype's range), so the
weight-only mode does not dequantize every tensor at load; the dequantize mode checks the
values it computes anyway (``dequantized``).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from dsv4.checkpoint import TensorValueError
from dsv4.quant_formats import FP4_VALUES, FP8_MAX, QuantizedTensor, scale_to_float32

__all__ = ["Pair", "Stored", "check_values", "dequantized"]


@attrs.frozen
class Stored:
    """Where a tensor is stored: its key as the file names it, and the file."""

    path: Path
    key: str


Pair = tuple[Stored, Stored | None]
"""A quantized weight and its scale (``None``: missing, which decoding reports)."""


def _first(bad: torch.Tensor) -> tuple[str, list[int]]:
    first = bad.nonzero()[0].tolist()
    return f"{int(bad.sum())} of {bad.numel()}", first


def check_values(
    qt: QuantizedTensor, dtype: torch.dtype, pair: Pair, values: torch.Tensor | None = None
) -> None:
    """Refuse NaN codes, non-finite scales, and values that overflow ``dtype`` (``values``:
    the dequantized tensor where already computed; else it is computed only when the largest
    scale times the format's largest code could overflow)."""
    weight, scale = pair
    assert scale is not None  # decode_weight refuses a quantized weight without its scale
    factors = scale_to_float32(qt.scale)
    bad = ~torch.isfinite(factors)
    if bool(bad.any()):
        count, first = _first(bad)
        was = float(factors[tuple(first)])
        raise TensorValueError(
            scale.key,
            scale.path.name,
            f"has non-finite scales (NaN or inf): {count}, the first {was} at index {first}; "
            "the weights are corrupt",
        )
    if qt.format == "fp8":
        bad = (qt.data.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's NaN codes
        if bool(bad.any()):
            count, first = _first(bad)
            raise TensorValueError(
                weight.key,
                weight.path.name,
                f"has NaN codes: {count}, the first at index {first}; the weights are corrupt",
            )
    largest = FP8_MAX if qt.format == "fp8" else max(FP4_VALUES)
    if values is None and float(factors.abs().max()) * largest <= torch.finfo(dtype).max:
        return
    values = qt.dequantize(dtype) if values is None else values
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        count, first = _first(bad)
        was = float(qt.dequantize(torch.float32)[tuple(first)])
        raise TensorValueError(
            weight.key,
            weight.path.name,
            f"has values that overflow {str(dtype).removeprefix('torch.')}: {count}, the first "
            f"{was:g} at index {first}; load it in float32 or bfloat16",
        )


def dequantized(qt: QuantizedTensor, dtype: torch.dtype, pair: Pair) -> torch.Tensor:
    values = qt.dequantize(dtype)
    check_values(qt, dtype, pair, values)
    return values
