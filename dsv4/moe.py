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

Experts run without data-dependent shapes or host syncs, so the MoE can be captured, in one of
two static formulations chosen from the shapes (a host-constant decision, frozen per captured
size): when ``E <= 2 * T * k`` every expert runs on every token (reading each expert's weights
once costs no more than copying the chosen ones) and the chosen outputs are gathered, a bounded
chunk of experts at a time (``DENSE_CHUNK_BYTES``); otherwise
each token runs on its gathered expert weights (``[T, k, ...]``). Either way the chosen outputs
are weighted and summed over the ``k`` slots the same way. It is a reference formulation, not a
fast grouped-GEMM kernel.

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
from dsv4.layers import as_dtype, read_rows
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


DENSE_CHUNK_BYTES = 256 << 20
"""What the every-expert formulation may hold per chunk of experts, about: their weights in
float32 three times over (while a weight-only stack dequantizes: its values, its scales
expanded to them, their products) and their activations for every token. At the published
sizes one expert already takes ~0.5 GiB, so each runs alone; whole stacks dequantized at once
took ~24 GiB per call."""


class ExpertFormulations(nn.Module):
    """The two static formulations of routed SwiGLU experts over stacked weights
    ``gate_up [E, 2I, hidden]`` (gate rows first) and ``down [E, hidden, I]``.

    A subclass says how its weights are read: ``_stacks(start, stop)`` gives both stacks of
    experts ``start:stop`` in the compute dtype (the every-expert formulation, a chunk at a
    time), ``_chosen_rows(experts)`` the chosen experts' rows ``[T, k, ...]`` (the gathered
    formulation); ``limit`` is the SwiGLU clamp. Plain and quantized experts share every other
    line, so they compute the same way by construction.
    """

    limit: float
    dense_chunk_bytes: int = DENSE_CHUNK_BYTES
    """Bytes per chunk of experts of the every-expert formulation (``DENSE_CHUNK_BYTES``)."""

    def _stacks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _stack_shape(self) -> tuple[int, int, int]:
        """``(E, 2I, hidden)``."""
        raise NotImplementedError

    def _chosen_rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, hidden]``, chosen ``experts [T, k]`` and their ``weights`` -> ``[T, hidden]``."""
        tokens, k = experts.shape
        if self._stack_shape()[0] <= 2 * tokens * k:
            out = self._chosen_of_all(x, experts)
        else:
            out = self._on_gathered_weights(x, experts)
        return (out * as_dtype(weights, out.dtype).unsqueeze(-1)).sum(dim=1)

    def _chosen_of_all(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's chosen outputs ``[T, k, hidden]``.

        Experts run a chunk at a time (``_experts_per_chunk``), each chunk's chosen outputs
        taken where a token chose one of its experts: every slot is one chunk's, so the result
        is the whole stack's, value for value, and a weight-only stack is only ever dequantized
        a chunk at a time. Expert-major: the weights are the left operand (``W @ x^T``,
        ``[C, rows, T]``), so each weight row streams once against all ``T`` tokens; with MKL
        on a CPU this also picks a faster kernel than ``x @ W^T`` once ``C * 2I`` is in the
        thousands.
        """
        num_experts = self._stack_shape()[0]
        step = self._experts_per_chunk(x.shape[0])
        if step >= num_experts:
            return self._chunk_outputs(x, experts, 0, num_experts)
        chosen = self._chunk_outputs(x, (experts).clamp(0, step - 1), 0, step)
        for start in range(step, num_experts, step):
            stop = min(start + step, num_experts)
            local = (experts - start).clamp(0, stop - start - 1)
            mine = ((experts >= start) & (experts < stop)).unsqueeze(-1)
            chosen = torch.where(mine, self._chunk_outputs(x, local, start, stop), chosen)
        return chosen

    def _chunk_outputs(
        self, x: torch.Tensor, local: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """Experts ``start:stop`` on every token, gathered at ``local`` (indices into the
        chunk) ``[T, k, hidden]``; its temporaries go when it returns."""
        _, double_inter, hidden_size = self._stack_shape()
        gate_up_stack, down_stack = self._stacks(start, stop)
        gate_up = torch.mm(gate_up_stack.flatten(0, 1), x.t())
        gate, up = gate_up.view(stop - start, double_inter, -1).chunk(2, dim=1)
        hidden = _swiglu(gate, up, self.limit)  # [C, I, T]
        out = torch.bmm(down_stack, hidden)  # [C, hidden, T]
        index = local.unsqueeze(-1).expand(*local.shape, hidden_size)
        return out.permute(2, 0, 1).gather(1, index)

    def _experts_per_chunk(self, tokens: int) -> int:
        """Experts whose float32 weights (three times, see ``DENSE_CHUNK_BYTES``) and
        activations for ``tokens`` tokens fit ``dense_chunk_bytes`` (at least one)."""
        num_experts, double_inter, hidden_size = self._stack_shape()
        weights = 3 * double_inter * hidden_size // 2  # gate_up and down of one expert
        activations = (2 * double_inter + hidden_size) * tokens
        per_expert = 4 * (3 * weights + activations)
        return max(1, min(num_experts, self.dense_chunk_bytes // per_expert))

    def _on_gathered_weights(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token on its chosen experts' gathered weights: ``[T, k, hidden]``."""
        gate_up_rows, down_rows = self._chosen_rows(experts)
        gate_up = torch.einsum("tkoh,th->tko", gate_up_rows, x)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = _swiglu(gate, up, self.limit)
        return torch.einsum("tkhi,tki->tkh", down_rows, hidden)


class Experts(ExpertFormulations):
    """Stacked expert weights: ``gate_up_proj [E, 2I, hidden]`` (gate rows first), ``down_proj``."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float
    ) -> None:
        super().__init__()
        self.limit = limit
        # torch.empty touches no memory: a model built for loading (parameters on meta, see
        # dsv4.materialize) never holds a float32 copy of the experts; zeroed in place here
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.zeros_(self.gate_up_proj)
        nn.init.zeros_(self.down_proj)

    def _stack_shape(self) -> tuple[int, int, int]:
        num_experts, double_inter, hidden_size = self.gate_up_proj.shape
        return num_experts, double_inter, hidden_size

    def _stacks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj[start:stop], self.down_proj[start:stop]

    def _chosen_rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return read_rows(self.gate_up_proj, experts), read_rows(self.down_proj, experts)


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
