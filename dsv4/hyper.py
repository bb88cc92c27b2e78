"""Manifold-constrained hyper-connections: a residual stream of ``hc_mult`` copies.

Each block reads one collapsed input (``pre``-weighted sum of the streams) and writes back
``post * block_output + comb^T @ streams``. ``pre``/``post``/``comb`` come from one linear map of
the RMS-normalised, flattened streams; ``comb`` is pushed towards a doubly-stochastic matrix by
``hc_sinkhorn_iters`` rounds of Sinkhorn normalisation (columns first). Everything that
computes the mixing weights runs in fp32 with fp32 parameters, as in the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.layers import rms_normalize

__all__ = ["HyperConnection", "HyperHead", "mix"]


class HyperConnection(nn.Module):
    """Mixing weights around one block (reference names ``fn``, ``base``, ``scale``)."""

    def __init__(
        self, hc_mult: int, hidden_size: int, *, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, n, hidden]`` -> ``post [T, n]``, ``comb [T, n, n]``, block input."""
        n = self.hc_mult
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1)
        comb = comb + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor
) -> torch.Tensor:
    """New streams: ``post * output`` spread over the copies plus ``comb^T @ streams``."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2)
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm (``hc_fn``/``hc_base``/``hc_scale``)."""

    def __init__(self, hc_mult: int, hidden_size: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
