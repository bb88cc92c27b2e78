"""Interleaved partial RoPE as DeepSeek-V4 uses it, with optional YaRN.

- Only the trailing ``rope_dim`` channels of a vector rotate; channel pairs ``(2i, 2i+1)`` turn
  by ``position * inv_freq[i]`` (a complex product), computed in fp32.
- ``inverse=True`` turns by ``-position``: the attention output is rotated back at the query
  position because values are the (rotated) keys.
- YaRN blends interpolated and extrapolated frequencies over a truncated correction range and
  may scale cos/sin by ``attention_factor``; the reference forces that factor to 1.0 for the
  flat compress layout, and this module simply applies whatever the config holds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4.config import YarnScaling

__all__ = ["RotaryEmbedding", "inverse_frequencies"]


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


class RotaryEmbedding(nn.Module):
    """One RoPE part (``main`` or ``compress``) for vectors whose trailing ``dim`` channels rotate.

    ``inv_freq`` is a non-persistent fp32 buffer: it moves with the module but is never part of
    a checkpoint, and the model keeps it in fp32 whatever its compute dtype.
    """

    inv_freq: torch.Tensor

    def __init__(self, dim: int, theta: float, yarn: YarnScaling | None) -> None:
        super().__init__()
        self.dim = dim
        self.scaling = yarn.attention_factor if yarn is not None else 1.0
        self.register_buffer("inv_freq", inverse_frequencies(dim, theta, yarn), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., dim // 2]`` cos and sin at ``positions``, rounded to ``dtype`` like the input."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        cos = (angles.cos() * self.scaling).to(dtype)
        sin = (angles.sin() * self.scaling).to(dtype)
        return cos, sin

    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate the trailing ``dim`` channels of ``x`` ``[..., width]``.

        ``cos``/``sin`` have the leading shape of ``x`` minus any axes between (they broadcast
        through a head axis when ``x`` is ``[T, heads, width]`` and ``cos`` is ``[T, 1, dim/2]``).
        """
        keep, turn = x[..., : -self.dim], x[..., -self.dim :]
        pairs = turn.float().unflatten(-1, (self.dim // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        c, s = cos.float(), (-sin if inverse else sin).float()
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((keep, rotated.to(x.dtype)), dim=-1)
