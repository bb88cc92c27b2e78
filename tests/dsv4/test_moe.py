"""The MoE's static formulations compute the same function; the router's top-k gives equal
scores to the lower expert index, alone or batched.

``Experts`` reads the chosen experts in place on a CPU (the native routed operator for float32 on
one thread, bagged with few slots per expert, grouped above), else runs every expert and gathers
the chosen outputs when ``E <= 2 * T * k``, else runs each token on its gathered expert weights.
Property: over random shapes, routings and weights every formulation equals a per-token loop
over the chosen experts written straight from the definition, and the module runs the one its
rule picks.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.config import DeepseekV4Config
from dsv4.expert_kernels import bagged, grouped, grouped_fits, routed, routed_takes
from dsv4.experts import BAG_SLOTS_PER_EXPERT
from dsv4.moe import Experts, Router
from dsv4.panels import in_panels
from graphs.op_count import OpCounter


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
    intermediate=st.sampled_from([4, 5]),  # 5: rows _grouped_mm cannot take (20 bytes)
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_every_formulation_equals_the_definition(
    num_experts: int, tokens: int, intermediate: int, data: st.DataObject, seed: int
) -> None:
    k = data.draw(st.integers(1, num_experts), label="k")
    generator = torch.Generator().manual_seed(seed)
    module = Experts(num_experts, hidden_size=12, intermediate_size=intermediate, limit=1.5)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    x = torch.randn(tokens, 12, generator=generator)
    experts = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, k, generator=generator)
    expected = _by_definition(module, x, experts, weights)
    stacks = (module.gate_up_proj, module.down_proj)
    with torch.inference_mode():
        slots = {
            "every": module._chosen_of_all(x, experts),
            "gathered": module._on_gathered_weights(x, experts),
            "bagged": bagged(x, experts, *stacks, module.limit),
        }
        if grouped_fits(x, module.gate_up_proj):
            slots["grouped"] = grouped(x, experts, *stacks, module.limit)
        chosen = module(x, experts, weights)
        panels = (in_panels(module.gate_up_proj), in_panels(module.down_proj))
        native = routed_takes(x, experts, *panels)
        if native:
            routed_sum = routed(x, experts, weights, *panels, module.limit)
    combined = {n: (out * weights.unsqueeze(-1)).sum(dim=1) for n, out in slots.items()}
    if native:
        combined["routed"] = routed_sum
    for result in combined.values():
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    bag = tokens * k <= BAG_SLOTS_PER_EXPERT * num_experts or "grouped" not in slots
    assert torch.equal(chosen, combined["routed" if native else "bagged" if bag else "grouped"])


def test_off_the_cpu_formulations_follow_the_slots_per_expert() -> None:
    """Where nothing is read in place (a dtype the in-place kernels do not take), every expert
    runs when ``E <= 2 * T * k``, else each token on its gathered weights."""
    module = Experts(4, hidden_size=8, intermediate_size=4, limit=1.5).double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, dtype=torch.float64))
    for tokens, k, formulation in ((1, 1, "gathered"), (2, 1, "every"), (1, 2, "every")):
        x = torch.randn(tokens, 8, dtype=torch.float64)
        experts = torch.arange(tokens * k).view(tokens, k) % 4
        assert not module._in_place(x)
        method = module._chosen_of_all if formulation == "every" else module._on_gathered_weights
        with torch.inference_mode():
            assert torch.equal(module._slot_outputs(x, experts), method(x, experts))


def _reference_choice(router: Router, x: torch.Tensor, k: int) -> list[list[int]]:
    """Biased score descending, then expert index ascending, from the scores ``router`` sees
    for this batch (same shapes, so the same bits)."""
    logits = F.linear(x, router.weight)
    if router.scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = F.softplus(logits).sqrt()
    biased = (scores + router.e_score_correction_bias).tolist()
    return [sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in biased]


@given(
    num_experts=st.integers(2, 9),
    tokens=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**16),
    scoring=st.sampled_from(["sqrtsoftplus", "sigmoid"]),
)
def test_equal_router_scores_go_to_the_lower_expert_alone_or_batched(
    num_experts: int, tokens: int, data: st.DataObject, seed: int, scoring: str
) -> None:
    """Experts with a zero router row and the same correction bias score exactly alike in any
    batch (a zero row gives a zero logit whatever the matmul's shape; equal non-zero rows need
    not: a one-row ``F.linear`` rounds identical rows differently). The chosen experts follow
    the rule (biased score descending, then the lower expert index), and a token routes the
    same alone as in its batch."""
    k = data.draw(st.integers(1, num_experts), label="k")
    zero = data.draw(st.lists(st.booleans(), min_size=num_experts, max_size=num_experts))
    bias = data.draw(
        st.lists(st.sampled_from([0.0, 0.25]), min_size=num_experts, max_size=num_experts)
    )
    config = attrs.evolve(
        DeepseekV4Config.tiny(),
        n_routed_experts=num_experts,
        num_experts_per_tok=k,
        scoring_func=scoring,
    )
    router = Router(config, hashed=False)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_experts, config.hidden_size, generator=generator)
    with torch.no_grad():
        router.weight.copy_(torch.where(torch.tensor(zero).unsqueeze(1), 0.0, rows))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
    x = torch.randn(tokens, config.hidden_size, generator=generator)
    ids = torch.zeros(tokens, dtype=torch.long)
    with torch.inference_mode():
        experts, weights = router(x, ids)
        assert experts.tolist() == _reference_choice(router, x, k)
        for t in range(tokens):
            alone_experts, alone_weights = router(x[t : t + 1], ids[:1])
            assert alone_experts.tolist() == _reference_choice(router, x[t : t + 1], k)
            assert torch.equal(alone_experts[0], experts[t])
            torch.testing.assert_close(alone_weights[0], weights[t])


def test_hash_routing_keeps_the_table_order_and_repeats() -> None:
    """Hash routing compares nothing: a token's experts are its table row, in order, and an
    expert listed twice counts twice (as in transformers)."""
    config = attrs.evolve(DeepseekV4Config.tiny(), n_routed_experts=4, num_experts_per_tok=3)
    router = Router(config, hashed=True)
    with torch.no_grad():
        router.weight.copy_(
            torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0))
        )
        router.tid2eid[5] = torch.tensor([3, 1, 3])
    x = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        experts, weights = router(x, torch.tensor([5]))
    assert experts.tolist() == [[3, 1, 3]]
    scores = F.softplus(F.linear(x, router.weight)).sqrt()[0]
    expected = scores[[3, 1, 3]] / scores[[3, 1, 3]].sum() * config.routed_scaling_factor
    torch.testing.assert_close(weights[0], expected)


@pytest.mark.skipif(native.KERNELS is None, reason=native.reason)
@given(
    tokens=st.integers(1, 6),
    num_experts=st.integers(2, 9),
    hashed=st.booleans(),
    scoring=st.sampled_from(["sqrtsoftplus", "sigmoid"]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_the_native_router_routes_as_the_composite(
    tokens: int, num_experts: int, hashed: bool, scoring: str, data: st.DataObject, seed: int
) -> None:
    """On the CPU the scores, the choice and the weights are one native op (``route_into``): the
    composite's experts (on scores apart by more than their last places) and its weights within
    float32 rounding (its exp and log1p against ATen's); a hash table pointing outside the
    experts is refused."""
    k = data.draw(st.integers(1, num_experts), label="k")
    config = attrs.evolve(
        DeepseekV4Config.tiny(),
        n_routed_experts=num_experts,
        num_experts_per_tok=k,
        scoring_func=scoring,
    )
    router = Router(config, hashed=hashed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 4)
        if hashed:
            router.tid2eid.copy_(torch.randint(0, num_experts, router.tid2eid.shape))
        else:
            router.e_score_correction_bias.copy_(torch.rand(num_experts, generator=generator))
    x = torch.randn(tokens, config.hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=generator)
    counter = OpCounter()
    with torch.inference_mode(), counter:
        experts, weights = router(x, ids)
    assert counter.by_name["route_into"] == 1
    composite_experts, composite_weights = router(x, ids)  # autograd records: ATen's ops
    assert torch.equal(experts, composite_experts)
    torch.testing.assert_close(weights, composite_weights.detach(), rtol=1e-5, atol=1e-7)
    if hashed:
        with torch.no_grad():
            router.tid2eid[ids[0]] = num_experts
        with torch.inference_mode(), pytest.raises(IndexError, match="index out of range"):
            router(x, ids)
