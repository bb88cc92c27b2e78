"""Interleaved partial RoPE as DeepSeek-V4 uses it, with optional YaRN.

- Only the trailing ``rope_dim`` channels of a vector rotate; channel pairs ``(2i, 2i+1)`` turn
  by ``position * inv_freq[i]`` (a complex product), computed in fp32.
- ``inverse=True`` turns by ``-position``: the attention output is rotated back at the query
  position because values are the (rotated) keys.
- YaRN blends interpolated and extrapolated frequencies over a truncated correction range and
  may scale cos/sin by ``attention_factor``; the reference forces that factor to 1.0 for the
  flat compress layout, and this module simply applies whatever the config holds.

Op economy: ``tables`` builds full-width ``cos``/``sin`` rows once per step and position set —
cos 1 and sin 0 on the channels that do not rotate, the frequency repeated over each pair, the
sign of the complex product folded into the frequency of the even channel (``sin(-a) == -sin(a)``
and ``cos(-a) == cos(a)`` exactly) — and ``rotate`` is then ``x * cos + swap_pairs(x) * sin``:
one gather and three element-wise ops for the whole vector instead of slicing, stacking and
concatenating. The rows of a narrower vector are the trailing channels of a wider one's
(``RotaryTables.last``), so one table serves every width at the same positions. Every product
and sum is the reference's own (``even*c - odd*s``, ``odd*c + even*s``; channels that do not
rotate get ``x*1 + y*0``), so the results round exactly where the reference rounds.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn

from dsv4.config import YarnScaling
from dsv4.layers import as_dtype
from dsv4.native_ops import COS_SIN_INTO, ROPE_INTO, native_takes

__all__ = ["RotaryEmbedding", "RotaryTables", "inverse_frequencies"]


def inverse_frequencies(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """``[dim // 2]`` fp32 inverse frequencies of one RoPE part."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if yarn is None:
        return 1.0 / (theta**exponents)
    base_freqs = theta**exponents
    extrapolated = 1.0 / base_freqs
    interpolated = 1.0 / (yarn.factor * base_freqs)

    def correction_dim(rotations: float) -> float:
        ratio = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


@attrs.frozen(kw_only=True, eq=False)
class RotaryTables:
    """Full-width fp32 ``cos``/``sin`` rows (see the module doc): ``[T, width]``, or
    ``[T, 1, width]`` for vectors with a head axis (``per_head``)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def last(self, width: int) -> RotaryTables:
        """The rows of a ``width``-channel vector: the trailing ``width`` channels."""
        if width == self.cos.shape[-1]:
            return self
        return RotaryTables(cos=self.cos[..., -width:], sin=self.sin[..., -width:])

    def per_head(self) -> RotaryTables:
        """The same rows with a head axis, for ``[T, heads, width]`` vectors."""
        return RotaryTables(cos=self.cos.unsqueeze(-2), sin=self.sin.unsqueeze(-2))


class _WidthTables(nn.Module):
    """Constant rows for one vector width: signed frequencies, scales, pair swap."""

    frequencies: torch.Tensor
    scale: torch.Tensor
    swap: torch.Tensor

    def __init__(self, width: int, inv_freq: torch.Tensor, scaling: float) -> None:
        super().__init__()
        keep, dim = width - 2 * inv_freq.shape[0], 2 * inv_freq.shape[0]
        if keep < 0:
            raise ValueError(f"a width of {width} channels cannot hold {dim} rotary channels")
        pair = torch.arange(dim).view(-1, 2).flip(-1).flatten()
        signs = torch.tensor([-1.0, 1.0]).repeat(dim // 2)
        tables = {
            "frequencies": torch.cat((torch.zeros(keep), inv_freq.repeat_interleave(2) * signs)),
            "scale": torch.cat((torch.ones(keep), torch.full((dim,), scaling))),
            "swap": torch.cat((torch.arange(keep), keep + pair)),
        }
        for name, value in tables.items():
            self.register_buffer(name, value, persistent=False)
        self.scaled = scaling != 1.0


def _rows_per_token(tables: RotaryTables, h: torch.Tensor) -> bool:
    """Whether ``tables`` hold one row per token of ``h`` ``[T, ..., width]`` (broadcast over
    its middle axes) as the native rotation reads them: contiguous rows, evenly spaced."""
    cos, sin = tables.cos, tables.sin
    return (
        cos.shape == sin.shape
        and cos.stride() == sin.stride()
        and cos.dim() <= h.dim()
        and cos.shape[0] == h.shape[0]
        and cos.shape[-1] == h.shape[-1]
        and all(size == 1 for size in cos.shape[1:-1])
        and cos.stride(-1) == 1
        and cos.dtype == torch.float32
        and cos.device.type == "cpu"
    )


class RotaryEmbedding(nn.Module):
    """One RoPE part (``main`` or ``compress``) for vectors whose trailing ``dim`` channels rotate.

    ``inv_freq`` is a non-persistent fp32 buffer: it moves with the module but is never part of
    a checkpoint, and the model keeps it in fp32 whatever its compute dtype. ``widths`` are the
    vector widths ``rotate`` serves; ``tables`` builds rows for the widest.
    """

    inv_freq: torch.Tensor

    def __init__(
        self, dim: int, theta: float, yarn: YarnScaling | None, widths: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.dim = dim
        self.scaling = yarn.attention_factor if yarn is not None else 1.0
        self.register_buffer("inv_freq", inverse_frequencies(dim, theta, yarn), persistent=False)
        self.widths = nn.ModuleDict(
            {str(w): _WidthTables(w, self.inv_freq, self.scaling) for w in widths}
        )
        self.width = max(widths, default=0)
        self.signature: tuple[object, ...] = (dim, theta, yarn, self.width)
        """What ``tables`` depends on beyond the positions and the dtype: modules with equal
        signatures build equal rows (``dsv4.attention`` shares them within a step)."""

    def _rows(self, width: int) -> _WidthTables:
        rows = self.widths[str(width)]
        assert isinstance(rows, _WidthTables)
        return rows

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """``[T, width]`` rows at ``positions`` ``[T, 1]`` for the widest vector served; cos/sin
        rounded to ``dtype`` first, as the reference rounds them to its input's dtype."""
        rows = self._rows(self.width)
        angles = positions * rows.frequencies  # int64 * fp32 computes in fp32
        cos, sin = _cos_sin(angles)
        if rows.scaled:
            cos, sin = cos * rows.scale, sin * rows.scale
        if dtype != torch.float32:
            cos, sin = cos.to(dtype).float(), sin.to(dtype).float()
        return RotaryTables(cos=cos, sin=sin)

    def rotate(
        self, x: torch.Tensor, tables: RotaryTables, *, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate the trailing ``dim`` channels of ``x`` ``[..., width]`` by ``tables`` of the
        same width and rank (``tables.last(width)``, ``.per_head()``)."""
        h = as_dtype(x, torch.float32)
        swap = self._rows(x.shape[-1]).swap
        if native_takes(h) and _rows_per_token(tables, h):  # on the CPU: one op, bit-equal
            out = torch.empty_like(h)
            ROPE_INTO(out, h, tables.cos, tables.sin, swap, inverse)
            return as_dtype(out, x.dtype)
        turned = h.index_select(-1, swap) * tables.sin
        rotated = h * tables.cos - turned if inverse else h * tables.cos + turned
        return as_dtype(rotated, x.dtype)


def _cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``angles.cos(), angles.sin()``: on the CPU one native op whose values are correctly
    rounded and the same on every instruction set (ATen's are within a unit in the last place,
    and which unit depends on the CPU's vector width); ATen's ops elsewhere."""
    if native_takes(angles):
        cos, sin = torch.empty_like(angles), torch.empty_like(angles)
        COS_SIN_INTO(cos, sin, angles)
        return cos, sin
    return angles.cos(), angles.sin()
