"""Mixture of experts: routed SwiGLU experts plus one shared expert.

Routing scores are ``score_fn(router logits)`` (sqrt-softplus or sigmoid). ``moe`` layers pick
the top ``num_experts_per_tok`` experts by score plus ``e_score_correction_bias`` (the bias only
chooses; the weights are the unbiased scores); ``hash_moe`` layers pick the experts of a fixed
token-id table ``tid2eid``. Chosen weights are normalised to sum to one and multiplied by
``routed_scaling_factor``. Expert activations clamp the gate from above and the up projection
on both sides at ``swiglu_limit``.

Experts run per token on gathered weights (``[T, k, ...]``): no data-dependent shapes and no
host syncs, so the MoE can be captured; it is a reference formulation, not a fast kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import DeepseekV4Config
from dsv4.layers import as_dtype

__all__ = ["MoE", "SharedExpert"]


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """Stacked expert weights: ``gate_up_proj [E, 2I, hidden]`` (gate rows first), ``down_proj``."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float
    ) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(
            torch.zeros(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up = torch.einsum("tkoh,th->tko", self.gate_up_proj[experts], x)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = _swiglu(gate, up, self.limit)
        out = torch.einsum("tkhi,tki->tkh", self.down_proj[experts], hidden)
        return (out * as_dtype(weights, out.dtype).unsqueeze(-1)).sum(dim=1)


class Router(nn.Module):
    """Router weights; ``tid2eid`` (hash layers) or ``e_score_correction_bias`` (others)."""

    tid2eid: torch.Tensor
    e_score_correction_bias: torch.Tensor

    def __init__(self, config: DeepseekV4Config, *, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts ``[T, k]`` and their weights ``[T, k]``."""
        logits = F.linear(x, self.weight)
        scores = (
            torch.sigmoid(logits) if self.scoring_func == "sigmoid" else F.softplus(logits).sqrt()
        )
        if self.hashed:
            experts = as_dtype(self.tid2eid[input_ids], torch.int64)
        else:
            biased = scores + self.e_score_correction_bias
            experts = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class MoE(nn.Module):
    """Routed experts plus the shared expert (``gate``, ``experts``, ``shared_experts``)."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        size, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Router(config, hashed=config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(config.n_routed_experts, size, inter, limit)
        self.shared_experts = SharedExpert(size, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        return self.experts(x, experts, weights) + self.shared_experts(x)
