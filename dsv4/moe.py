"""Mixture of experts: routed SwiGLU experts plus one shared expert.

Routing scores are ``score_fn(router logits)`` (sqrt-softplus or sigmoid). ``moe`` layers pick
the top ``num_experts_per_tok`` experts by score plus ``e_score_correction_bias`` (the bias only
chooses; the weights are the unbiased scores); ``hash_moe`` layers pick the experts of a fixed
token-id table ``tid2eid``. The top-k rule is ``dsv4.selection.stable_topk``'s: among equal
biased scores the lower expert index wins, and the chosen experts come in descending order of
biased score, then ascending index, whatever the batch, formulation or parallel size (an expert
index is global: every rank routes with the whole router). Hash routing compares nothing: the
table's row is the choice, in the table's order, and an expert listed twice is chosen twice
(its weight counted twice, as in the reference). Chosen weights are normalised to sum to one
and multiplied by ``routed_scaling_factor``. Expert activations clamp the gate from above and
the up projection on both sides at ``swiglu_limit``.

The routed experts and their formulations (grouped, every expert, gathered: how each reads its
weights, and when each runs) live in ``dsv4.experts``.

Expert and tensor parallelism (``parallel``): the router is replicated (every rank routes every
token the same way; it is small), each rank holds a contiguous ``n_routed_experts / N`` of the
routed experts (a choice of another rank's expert weighs zero here: ``local_choice``), and the
shared expert is split column/row (``moe_intermediate_size / N`` of its gate and up rows, the
matching columns of its down projection). Each rank's routed and shared partial outputs are
added, then summed over the ranks by one all-reduce per MoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import DeepseekV4Config
from dsv4.expert_kernels import swiglu
from dsv4.experts import DENSE_CHUNK_BYTES, ExpertFormulations, Experts
from dsv4.layers import Linear, as_dtype, panel_product, read_rows
from dsv4.native_ops import ROUTE_INTO, SWIGLU_MLP_INTO, native_takes
from dsv4.panels import PanelCopy
from dsv4.parallel import SINGLE, TensorParallel
from dsv4.selection import stable_topk

__all__ = [
    "DENSE_CHUNK_BYTES",
    "ExpertFormulations",
    "Experts",
    "MoE",
    "SharedExpert",
    "local_choice",
]


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP; on one CPU thread, where each of the three products reads a copy in panels
        (``dsv4.layers.Linear.panels_for``), all of it one native op on those copies."""
        panels = self._fused_panels(x)
        if panels is not None:
            inter = self.gate_proj.weight.shape[0]
            gated, upped, activated = (x.new_empty(x.shape[0], inter) for _ in range(3))
            out = torch.empty_like(x)
            SWIGLU_MLP_INTO(out, gated, upped, activated, x, *panels, self.limit)
            return out
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))

    def _fused_panels(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The gate, up and down copies in panels where ``x`` (float32 ``[T, hidden]``) runs as
        one native op (``swiglu_mlp_into``), else ``None``."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        plain = all(type(p) is Linear for p in projections)  # not replaced by quantized ones
        if not plain or x.dim() != 2 or x.dtype != torch.float32:
            return None
        gate, up = self.gate_proj.panels_for(x), self.up_proj.panels_for(x)
        down = self.down_proj.panels_for(x, x.shape[-1])  # as many rows as x
        if gate is None or up is None or down is None:
            return None
        return gate, up, down


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
        self.weight_panels: torch.Tensor | None
        self._copy = PanelCopy(self, "weight_panels")
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def pack_panels(self) -> int:
        """Keep a copy of the weight in panels (``dsv4.panels.PanelCopy``); returns its bytes."""
        return self._copy.pack_matrix(self, self.weight)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts ``[T, k]`` and their weights ``[T, k]``. On the CPU (float32) the
        scores, the choice and the weights are one native op (``dsv4::route_into``), whose
        scores may differ from ATen's in the last place (its ``exp``, ``log1p``)."""
        logits = panel_product(self, self._copy, x, self.weight)
        bias = None if self.hashed else self.e_score_correction_bias
        if native_takes(logits, bias) and 0 < self.top_k <= logits.shape[-1]:
            tokens = logits.shape[0]
            if self.hashed:
                experts = as_dtype(read_rows(self.tid2eid, input_ids), torch.int64).contiguous()
            else:
                experts = torch.empty(tokens, self.top_k, dtype=torch.int64)
            weights, scores, biased = (
                logits.new_empty(experts.shape),
                *(torch.empty_like(logits) for _ in range(2)),
            )
            ROUTE_INTO(
                experts,
                weights,
                scores,
                biased,
                logits,
                bias,
                self.scaling,
                self.scoring_func == "sigmoid",
            )
            return experts, weights
        scores = (
            torch.sigmoid(logits) if self.scoring_func == "sigmoid" else F.softplus(logits).sqrt()
        )
        if self.hashed:
            experts = as_dtype(read_rows(self.tid2eid, input_ids), torch.int64)
        else:
            biased = scores + self.e_score_correction_bias
            experts = stable_topk(biased, self.top_k)
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


def local_choice(
    experts: torch.Tensor, weights: torch.Tensor, local: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing ``experts``/``weights`` ``[T, k]`` as seen by a rank holding experts
    ``local``: indices into its stack (clamped into it where the expert is another rank's) and
    the weights, zero for the other ranks' experts. Shapes stay static: no host sync."""
    shifted = experts - local.start
    inside = (shifted >= 0) & (shifted < len(local))
    return shifted.clamp(0, len(local) - 1), torch.where(inside, weights, 0)


class MoE(nn.Module):
    """Routed experts plus the shared expert (``gate``, ``experts``, ``shared_experts``); with
    tensor parallelism, this rank's share of both (see the module docstring)."""

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        size, limit = config.hidden_size, config.swiglu_limit
        self.parallel = parallel
        self.local_experts = parallel.share(config.n_routed_experts)
        inter = len(parallel.share(config.moe_intermediate_size))
        self.gate = Router(config, hashed=config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(len(self.local_experts), size, config.moe_intermediate_size, limit)
        self.shared_experts = SharedExpert(size, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        if self.parallel.size > 1:
            experts, weights = local_choice(experts, weights, self.local_experts)
        out = self.experts(x, experts, weights) + self.shared_experts(x)
        return self.parallel.all_reduce_(out)
