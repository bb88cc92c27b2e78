"""Byte formats of the published quantized DeepSeek-V4 checkpoint: decode and validate.

Two formats (REFERENCE §D), both vectorised (no Python loop over elements or blocks), both with
optional leading dimensions (``[..., out, in]``, e.g. a stack of experts ``[E, P, out, in]``):

- **FP8 blocks.** ``q [..., out, in]`` in ``float8_e4m3fn`` with a scale grid
  ``[..., ceil(out / b0), ceil(in / b1)]`` (``block_size = (b0, b1)``, normally 128×128); the
  edge blocks of a dimension that is not a multiple of the block are partial. The value is
  ``w[i, j] = float(q[i, j]) * float(scale[i // b0, j // b1])``, one float32 multiply, the same
  product transformers computes (its load-time dequantizer reads partial edge blocks above one
  block wrongly, see ``transformers_block_size``; this module follows the ceil grid).
- **MXFP4.** ``packed [..., out, in / 2]`` in ``int8`` (or ``uint8``): element ``2j`` in the low
  nibble of byte ``j``, element ``2j + 1`` in the high nibble; code ``c`` means
  ``FP4_VALUES[c]``; scale ``[..., out, in / 32]`` ue8m0, one per 32 consecutive inputs.

Scales are float32 or ue8m0 (``float8_e8m0fnu``, or its raw exponent bytes as ``uint8``): the
power of two ``2 ** (b - 127)``; ``b = 255`` is NaN. ``scale_to_float32`` decodes both exactly.

Every decode is a fixed sequence of tensor ops whose shapes follow from the input shapes alone,
so it captures on a graph tape (no host sync, no data-dependent shape). Dequantization computes
in float32 and casts once to the requested dtype, so a weight dequantized here equals the one
transformers builds, bit for bit, in every dtype.

Invalid pairs raise ``QuantizationError`` (a ``CheckpointError``) with one line naming the tensor.
``QuantizedTensor`` is a validated (bytes, scale, format) triple. The encoders (float -> bytes)
live with the writer, ``dsv4.quantized_writer``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import attrs
import torch

from dsv4.errors import CheckpointError

__all__ = [
    "FP4_VALUES",
    "FP8_DTYPE",
    "FP8_MAX",
    "MXFP4_GROUP",
    "QuantizationError",
    "QuantizedTensor",
    "block_grid",
    "check_fp8_pair",
    "check_mxfp4_pair",
    "dequantize",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "expand_block_scale",
    "fp4_pair_table",
    "scale_to_float32",
    "transformers_block_size",
    "ue8m0_dtype",
    "unpack_fp4",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""
MXFP4_GROUP = 32
"""Inputs sharing one MXFP4 scale."""
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""E2M1 value of each 4-bit code."""
_SCALE_DTYPES = (torch.float32, torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))


class QuantizationError(CheckpointError):
    """A quantized tensor (or quantization config) the model cannot load; the message names it."""


def ue8m0_dtype() -> torch.dtype:
    """``torch.float8_e8m0fnu`` (torch >= 2.7), or ``QuantizationError`` where torch lacks it."""
    dtype = getattr(torch, "float8_e8m0fnu", None)
    if dtype is None:
        raise QuantizationError(
            f"scale_fmt 'ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7); torch is "
            f"{torch.__version__}"
        )
    return dtype


def block_grid(rows: int, cols: int, block_size: Sequence[int]) -> tuple[int, int]:
    """The scale grid ``(ceil(rows / b0), ceil(cols / b1))`` of a ``[rows, cols]`` weight."""
    return math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1])


def transformers_block_size(rows: int, cols: int, grid: Sequence[int]) -> tuple[int, int] | None:
    """The block transformers 5.23.0's load-time dequantizer assumes: ``dim // grid``; ``None``
    where it raises (a dimension not divisible by its grid). It equals the real block only for
    dimensions up to one block or multiples of it (REFERENCE §D, quirk 1)."""
    if rows % grid[0] or cols % grid[1]:
        return None
    return rows // grid[0], cols // grid[1]


# -- scales -----------------------------------------------------------------------------------


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of a float32, ``float8_e8m0fnu`` or raw-ue8m0 ``uint8`` scale tensor.

    ``uint8`` bytes are decoded from their bits (``b << 23`` is the float32 ``2 ** (b - 127)``
    for ``b`` in 1..254; ``b = 0`` is the subnormal ``2 ** -127``; ``b = 255`` NaN), which is
    exactly what the native ``float8_e8m0fnu`` conversion gives.
    """
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype == torch.uint8:
        bits = scale.to(torch.int32) << 23
        bits = torch.where(scale == 0, 0x00400000, bits)
        bits = torch.where(scale == 255, 0x7F800001, bits)  # the NaN torch decodes 255 to
        return bits.view(torch.float32)
    return scale.to(torch.float32)


# -- FP8 blocks -------------------------------------------------------------------------------


def expand_block_scale(
    scale: torch.Tensor, rows: int, cols: int, block: Sequence[int]
) -> torch.Tensor:
    """``scale[..., i // b0, j // b1]`` for every ``(i, j)`` of a ``[..., rows, cols]`` weight
    (the scale grid expanded over its blocks and cropped to the weight: the ceil grid)."""
    *lead, grid_rows, grid_cols = scale.shape
    b0, b1 = block
    full = scale[..., :, None, :, None].expand(*lead, grid_rows, b0, grid_cols, b1)
    return full.reshape(*lead, grid_rows * b0, grid_cols * b1)[..., :rows, :cols]


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q [..., out, in] * scale`` over ``block_size`` blocks (ceil grid), in ``dtype``.

    ``q`` is ``float8_e4m3fn`` (or its raw bytes as ``uint8``); the shapes must already have
    been checked (``check_fp8_pair``). When both dimensions are whole blocks the product runs on
    a blocked view, otherwise over the expanded, cropped scale; both are the same float32
    products.
    """
    values = (q.view(FP8_DTYPE) if q.dtype == torch.uint8 else q).to(torch.float32)
    factors = scale_to_float32(scale)
    *lead, rows, cols = values.shape
    b0, b1 = block_size
    if rows % b0 == 0 and cols % b1 == 0:
        blocked = values.view(*lead, rows // b0, b0, cols // b1, b1)
        out = (blocked * factors[..., :, None, :, None]).view(*lead, rows, cols)
    else:
        out = values * expand_block_scale(factors, rows, cols, block_size)
    return out if dtype == torch.float32 else out.to(dtype)


def check_fp8_pair(
    name: str, q: torch.Tensor, scale: torch.Tensor | None, block_size: Sequence[int]
) -> None:
    """Raise ``QuantizationError`` naming ``name`` unless ``q`` is an FP8 weight with a float32
    or ue8m0 scale on its ceil block grid (leading dimensions must agree)."""
    if q.dtype not in (FP8_DTYPE, torch.uint8):
        raise QuantizationError(f"tensor {name!r} is {q.dtype}, expected float8_e4m3fn")
    if q.dim() < 2:
        raise QuantizationError(f"FP8 tensor {name!r} has shape {list(q.shape)}, expected 2-D")
    if scale is None:
        raise QuantizationError(
            f"FP8 tensor {name!r} has no scale (expected '<weight>.scale' or "
            "'<weight>.weight_scale_inv')"
        )
    grid = block_grid(q.shape[-2], q.shape[-1], block_size)
    expected = (*q.shape[:-2], *grid)
    _check_scale(name, "FP8", q, scale, expected, f"{list(block_size)} blocks (ceil grid)")


def _check_scale(
    name: str,
    kind: str,
    data: torch.Tensor,
    scale: torch.Tensor,
    expected: tuple[int, ...],
    grid: str,
) -> None:
    if scale.dtype not in _SCALE_DTYPES:
        raise QuantizationError(
            f"scale of {kind} tensor {name!r} is {scale.dtype}, expected float32 or "
            "float8_e8m0fnu (ue8m0)"
        )
    if tuple(scale.shape) != expected:
        raise QuantizationError(
            f"scale of {kind} tensor {name!r} has shape {list(scale.shape)}, expected "
            f"{list(expected)} for a weight of shape {list(data.shape)} with {grid}"
        )


# -- MXFP4 ------------------------------------------------------------------------------------


def fp4_pair_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[256, 2]`` float32: the FP4 values (low nibble, high nibble) of every byte; modules
    that decode on every call keep one as a buffer instead of rebuilding it."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((values[codes & 15], values[codes >> 4]), dim=-1)


def unpack_fp4(packed: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 values ``[..., out, 2 * n]`` of packed FP4 bytes ``[..., out, n]``: one
    ``index_select`` into ``table`` (default: a fresh ``fp4_pair_table``)."""
    if table is None:
        table = fp4_pair_table(packed.device)
    index = packed.view(torch.uint8).reshape(-1).to(torch.int32)
    pairs = table.index_select(0, index)
    return pairs.view(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``unpack_fp4(packed) [..., out, in]`` times its per-32-input scale, in ``dtype``."""
    values = unpack_fp4(packed, table)
    *lead, rows, cols = values.shape
    groups = values.view(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    out = (groups * scale_to_float32(scale)[..., None]).view(*lead, rows, cols)
    return out if dtype == torch.float32 else out.to(dtype)


def check_mxfp4_pair(name: str, packed: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Raise ``QuantizationError`` naming ``name`` unless ``packed`` is int8/uint8 FP4 data
    with a ue8m0 (or float32) scale of shape ``[..., out, 2 * n / 32]``."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise QuantizationError(f"tensor {name!r} is {packed.dtype}, expected int8 (packed FP4)")
    if packed.dim() < 2 or (2 * packed.shape[-1]) % MXFP4_GROUP:
        raise QuantizationError(
            f"packed FP4 tensor {name!r} has shape {list(packed.shape)}: expected [out, in / 2] "
            f"with in a multiple of {MXFP4_GROUP}"
        )
    if scale is None:
        raise QuantizationError(
            f"FP4 tensor {name!r} has no scale (expected '<weight>.scale' or "
            "'<weight>.weight_scale_inv')"
        )
    expected = (*packed.shape[:-1], 2 * packed.shape[-1] // MXFP4_GROUP)
    _check_scale(name, "FP4", packed, scale, expected, f"one scale per {MXFP4_GROUP} inputs")


# -- a quantized tensor -----------------------------------------------------------------------


@attrs.frozen(eq=False)
class QuantizedTensor:
    """Quantized bytes and their scales, validated: ``format`` is ``"fp8"`` (``block_size`` the
    FP8 block) or ``"mxfp4"`` (``block_size`` ``(1, 32)``); ``data``/``scale`` may carry leading
    dimensions (a stack). Build with ``fp8``/``mxfp4``/``stack``, which check the shapes."""

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int]

    @classmethod
    def fp8(
        cls, name: str, data: torch.Tensor, scale: torch.Tensor | None, block_size: Sequence[int]
    ) -> QuantizedTensor:
        """An FP8 block-quantized weight (``check_fp8_pair`` names ``name`` on failure)."""
        check_fp8_pair(name, data, scale, block_size)
        assert scale is not None
        return cls("fp8", data, scale, (int(block_size[0]), int(block_size[1])))

    @classmethod
    def mxfp4(cls, name: str, data: torch.Tensor, scale: torch.Tensor | None) -> QuantizedTensor:
        """An MXFP4 weight (``check_mxfp4_pair`` names ``name`` on failure)."""
        check_mxfp4_pair(name, data, scale)
        assert scale is not None
        return cls("mxfp4", data, scale, (1, MXFP4_GROUP))

    @classmethod
    def stack(cls, name: str, items: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """``items`` stacked along a new first dimension (same format, shapes and dtypes)."""
        first = items[0]
        for item in items[1:]:
            if (item.format, item.block_size, item.data.shape, item.scale.shape) != (
                first.format,
                first.block_size,
                first.data.shape,
                first.scale.shape,
            ) or (item.data.dtype, item.scale.dtype) != (first.data.dtype, first.scale.dtype):
                raise QuantizationError(
                    f"quantized tensors stacked into {name!r} differ in format, dtype or shape"
                )
        data = torch.stack([item.data for item in items])
        scale = torch.stack([item.scale for item in items])
        return cls(first.format, data, scale, first.block_size)

    def chunks(self, max_values: int) -> Iterator[tuple[tuple[int | slice, ...], QuantizedTensor]]:
        """Blocks of rows in order, as ``(index, part)``: ``part`` holds the bytes and scales of
        the values ``index`` selects (an integer per leading dimension, then a slice of rows).
        A part has at most ``max_values`` values where one row of scales allows: FP8 parts are
        whole blocks of rows (all but the last), so each part's scales are its own."""
        *lead, rows, cols = self.shape
        unit = self.block_size[0]
        step = max(1, max_values // max(cols, 1) // unit) * unit
        for prefix in itertools.product(*(range(n) for n in lead)):
            for start in range(0, rows, step):
                stop = min(start + step, rows)
                index: tuple[int | slice, ...] = (*prefix, slice(start, stop))
                scales: tuple[int | slice, ...] = (*prefix, slice(start // unit, -(-stop // unit)))
                part = QuantizedTensor(
                    self.format, self.data[index], self.scale[scales], self.block_size
                )
                yield index, part

    def narrow(self, name: str, dim: int, start: int, stop: int) -> QuantizedTensor:
        """Values ``start .. stop - 1`` of logical dimension ``dim`` (a tensor-parallel part):
        views of their bytes and of the scales that cover them.

        A part must map onto scale blocks of its own: along the FP8 rows or columns it starts on
        a block boundary or lies within one block (its one scale row or column is then that
        block's), along MXFP4 inputs it is whole 32-input groups; leading dimensions split
        freely. Otherwise ``QuantizationError`` names ``name`` and the part, on one line."""
        shape = self.shape
        dim %= len(shape)
        lead = len(shape) - 2
        data: list[slice] = [slice(None)] * self.data.dim()
        scale: list[slice] = [slice(None)] * self.scale.dim()
        if dim < lead:
            data[dim] = scale[dim] = slice(start, stop)
            return QuantizedTensor(
                self.format, self.data[tuple(data)], self.scale[tuple(scale)], self.block_size
            )
        block = self.block_size[dim - lead]
        packed = self.format == "mxfp4" and dim == len(shape) - 1
        if packed:
            fits = start % block == 0 and stop % block == 0
        else:
            fits = start % block == 0 or start // block == (stop - 1) // block
        if not fits:
            kind = "32-input MXFP4 groups" if packed else f"{block}-wide FP8 scale blocks"
            raise QuantizationError(
                f"tensor {name!r} cannot be split for tensor parallelism: the part "
                f"{start}..{stop - 1} of dimension {dim} does not fit {kind} (a part must start "
                "on a block boundary or lie within one block)"
            )
        data[dim] = slice(start // 2, stop // 2) if packed else slice(start, stop)
        scale[dim] = slice(start // block, -(-stop // block))
        return QuantizedTensor(
            self.format, self.data[tuple(data)], self.scale[tuple(scale)], self.block_size
        )

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape."""
        if self.format == "mxfp4":
            return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: quantized data plus scales."""
        return _nbytes(self.data) + _nbytes(self.scale)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, table: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The values in ``dtype`` (computed in float32, cast once)."""
        return dequantize(self.format, self.data, self.scale, self.block_size, dtype, table)


def dequantize(
    format: str,
    data: torch.Tensor,
    scale: torch.Tensor,
    block_size: Sequence[int],
    dtype: torch.dtype = torch.float32,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize_mxfp4`` for ``format == "mxfp4"``, else ``dequantize_fp8``."""
    if format == "mxfp4":
        return dequantize_mxfp4(data, scale, dtype, table)
    return dequantize_fp8(data, scale, block_size, dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
