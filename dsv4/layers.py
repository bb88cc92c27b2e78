"""Small building blocks: RMS norms and the grouped (block-diagonal) output projection.

Numerics follow the reference: norms compute in fp32; a weighted norm multiplies by its fp32
weight before casting back once, so bf16 models round where the reference rounds.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GroupedLinear", "RMSNorm", "rms_normalize"]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last axis (statistics in fp32, result in ``x.dtype``)."""
    scale = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * scale.to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMS norm; ``weight`` stays fp32 (the model never casts it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class GroupedLinear(nn.Module):
    """``groups`` independent linear maps, group g using rows ``g*out .. (g+1)*out - 1``.

    ``weight`` is ``[groups * out_per_group, in_per_group]`` (the checkpoint layout); the input
    is ``[..., groups, in_per_group]`` and the output ``[..., groups, out_per_group]``.
    """

    def __init__(self, in_per_group: int, out_total: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_total, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("...gi,goi->...go", x, w)
