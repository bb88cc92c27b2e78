"""The MoE's two static formulations compute the same function.

``Experts`` runs every expert and gathers the chosen outputs when ``E <= 2 * T * k``, else runs
each token on its gathered expert weights; whole-model tests against transformers mostly see the
first (prompts are long). Property: over random shapes, routings and weights both equal a
per-token loop over the chosen experts written straight from the definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4.moe import Experts


def _by_definition(
    experts_module: Experts, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    limit = experts_module.limit
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=x.dtype)
        for slot in range(experts.shape[1]):
            e = int(experts[t, slot])
            gate, up = (experts_module.gate_up_proj[e] @ x[t]).chunk(2)
            hidden = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            total += weights[t, slot] * (experts_module.down_proj[e] @ hidden)
        rows.append(total)
    return torch.stack(rows)


@given(
    num_experts=st.integers(1, 9),
    tokens=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_both_formulations_equal_the_definition(
    num_experts: int, tokens: int, data: st.DataObject, seed: int
) -> None:
    k = data.draw(st.integers(1, num_experts), label="k")
    generator = torch.Generator().manual_seed(seed)
    module = Experts(num_experts, hidden_size=12, intermediate_size=5, limit=1.5)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    x = torch.randn(tokens, 12, generator=generator)
    experts = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, k, generator=generator)
    expected = _by_definition(module, x, experts, weights)
    with torch.inference_mode():
        dense = (module._chosen_of_all(x, experts) * weights.unsqueeze(-1)).sum(dim=1)
        gathered = (module._on_gathered_weights(x, experts) * weights.unsqueeze(-1)).sum(dim=1)
        chosen = module(x, experts, weights)
    for result in (dense, gathered):
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    uses_dense = num_experts <= 2 * tokens * k
    assert torch.equal(chosen, dense if uses_dense else gathered)
