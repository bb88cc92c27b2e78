"""``dsv4::routed_experts_into``: the routed experts' weighted sum in one native operator.

Each token's output is its slots' expert outputs, weighted and added, within a float32 sum's
error bound of the float64 definition; it depends on that token's routing only (alone or among
any other tokens, the same bits, whichever order the kernel multiplied its rows in); the tape
replays it bound to its addresses like eager; and an expert index outside the stacks is an
error that writes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.expert_kernels import ROUTED_TOKENS, routed, routed_takes
from dsv4.experts import Experts
from dsv4.native_ops import ROUTED_EXPERTS_INTO
from dsv4.panels import PANEL, in_panels, pack_model
from graphs import BreakableCapture, TapeBackend
from graphs.static_memory import StaticMemory

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)

LIMIT = 1.5


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> Experts:
    module = Experts(num_experts, hidden, inter, limit=LIMIT)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / hidden**0.5)
    return module


def _definition(
    module: Experts, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum in float64, and the same sum over the terms' magnitudes (for a bound)."""
    gate_up, down = module.gate_up_proj.double(), module.down_proj.double()
    exact = torch.zeros(x.shape, dtype=torch.float64)
    magnitude = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[t, slot])
            gate, up = (gate_up[e] @ x[t].double()).chunk(2)
            hidden = F.silu(gate.clamp(max=LIMIT)) * up.clamp(min=-LIMIT, max=LIMIT)
            exact[t] += weights[t, slot] * (down[e] @ hidden)
            scale = (gate_up[e].abs() @ x[t].double().abs()).chunk(2)
            bound = scale[0].clamp(max=4 * LIMIT) * scale[1].clamp(max=LIMIT) + hidden.abs()
            magnitude[t] += weights[t, slot] * (down[e].abs() @ bound)
    return exact, magnitude


@given(
    num_experts=st.integers(1, 6),
    tokens=st.integers(1, 12),
    hidden=st.sampled_from([8, 32, 45, 64, 130]),  # below, at and past 16- and 64-column strips
    inter=st.sampled_from([5, 16, 32]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_routed_is_within_a_float32_bound_and_each_token_is_its_own(
    num_experts: int, tokens: int, hidden: int, inter: int, data: st.DataObject, seed: int
) -> None:
    k = data.draw(st.integers(1, 4), label="k")  # repeats allowed, as hash routing repeats
    generator = torch.Generator().manual_seed(seed)
    module = _experts(num_experts, hidden, inter, seed)
    x = torch.randn(tokens, hidden, generator=generator)
    experts = torch.randint(0, num_experts, (tokens, k), generator=generator)
    weights = torch.rand(tokens, k, generator=generator)
    stacks = (in_panels(module.gate_up_proj), in_panels(module.down_proj))
    widths = (2 * inter, hidden)
    panel_widths = [data.draw(st.sampled_from(_divisors(w)), label="panel") for w in widths]
    packed = tuple(
        in_panels(s, p)
        for s, p in zip((module.gate_up_proj, module.down_proj), panel_widths, strict=True)
    )
    with torch.inference_mode():
        assert routed_takes(x, experts, *stacks)
        got = routed(x, experts, weights, *stacks, LIMIT)
        alone = [
            routed(x[t : t + 1], experts[t : t + 1], weights[t : t + 1], *stacks, LIMIT)
            for t in range(tokens)
        ]
        in_other_panels = routed(x, experts, weights, *packed, LIMIT)
    exact, magnitude = _definition(module, x, experts, weights)
    # each product and sum rounds once (FMAs, SwiGLU's exp to a few ulp): a generous float32 bound
    depth = hidden + inter + k
    assert bool(((got.double() - exact).abs() <= 4 * depth * 2**-24 * magnitude + 1e-30).all())
    assert all(torch.equal(got[t : t + 1], row) for t, row in enumerate(alone))
    assert torch.equal(in_other_panels, got)  # the same operations, whatever the panels


def _divisors(width: int) -> list[int]:
    return [p for p in range(1, width + 1) if width % p == 0]


def test_the_tape_replays_routed_bound_like_eager() -> None:
    module = _experts(5, 64, 32, seed=0)
    generator = torch.Generator().manual_seed(1)
    x, weights = torch.randn(6, 64, generator=generator), torch.rand(6, 2, generator=generator)
    experts = torch.randint(0, 5, (6, 2), generator=generator)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = module(x, experts, weights)
        for seed in (2, 3):
            fresh = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(6, 64, generator=fresh))
            experts.copy_(torch.randint(0, 5, (6, 2), generator=fresh))
            capture.replay()
            assert torch.equal(out, module(x.clone(), experts.clone(), weights))


def test_an_expert_outside_the_stacks_raises_and_writes_nothing() -> None:
    module = _experts(3, 32, 16, seed=0)
    x, weights = torch.randn(2, 32), torch.rand(2, 2)
    out = torch.full((2, 32), 7.0)
    with torch.inference_mode(), pytest.raises(IndexError, match="index out of range"):
        ROUTED_EXPERTS_INTO(
            out,
            x,
            torch.tensor([[0, 1], [2, 3]]),
            weights,
            in_panels(module.gate_up_proj),
            in_panels(module.down_proj),
            LIMIT,
        )
    assert bool((out == 7.0).all())


def test_routed_runs_for_float32_steps_on_one_thread_only() -> None:
    module = _experts(4, 32, 16, seed=0)
    stacks = (in_panels(module.gate_up_proj), in_panels(module.down_proj))
    experts = torch.zeros(1, 2, dtype=torch.long)
    with torch.inference_mode():
        assert routed_takes(torch.randn(ROUTED_TOKENS + 1, 32), experts, *stacks)
        assert not routed_takes(torch.randn(1, 32).double(), experts, *stacks)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert not routed_takes(torch.randn(1, 32), experts, *stacks)
        finally:
            torch.set_num_threads(previous)
    assert not routed_takes(torch.randn(1, 32), experts, *stacks)  # autograd records
    with torch.inference_mode():  # the parameters as they are: not laid out in panels
        assert not routed_takes(torch.randn(1, 32), experts, module.gate_up_proj, module.down_proj)


def test_a_step_longer_than_one_call_gives_each_tokens_own_sum() -> None:
    """Past ``ROUTED_TOKENS`` tokens the operator runs on chunks: every token's sum is the one
    it gets alone, bit for bit, wherever the chunks cut."""
    module = _experts(6, 32, 16, seed=2)
    stacks = (in_panels(module.gate_up_proj.detach()), in_panels(module.down_proj.detach()))
    generator = torch.Generator().manual_seed(3)
    tokens = ROUTED_TOKENS + 5
    x = torch.randn(tokens, 32, generator=generator)
    experts = torch.randint(0, 6, (tokens, 2), generator=generator)
    weights = torch.rand(tokens, 2, generator=generator)
    with torch.inference_mode():
        whole = routed(x, experts, weights, *stacks, LIMIT)
        for t in (0, ROUTED_TOKENS - 1, ROUTED_TOKENS, tokens - 1):
            alone = routed(x[t : t + 1], experts[t : t + 1], weights[t : t + 1], *stacks, LIMIT)
            assert torch.equal(whole[t : t + 1], alone)
    exact, magnitude = _definition(module, x[-3:], experts[-3:], weights[-3:])
    bound = 4 * (32 + 16 + 2) * 2**-24 * magnitude + 1e-30  # as for a step of one call
    assert bool(((whole[-3:].double() - exact).abs() <= bound).all())


def test_stacks_in_panels_hold_each_experts_columns_contiguous() -> None:
    stack = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)  # [E, out, in]
    panels = in_panels(stack, 2)
    assert panels.shape == (2, 3, 3, 2) and panels.is_contiguous()
    for e, p, i, q in [(0, 0, 0, 0), (1, 2, 1, 1), (1, 1, 2, 0)]:
        assert panels[e, p, i, q] == stack[e, 2 * p + q, i]
    with pytest.raises(ValueError, match="do not cut into panels of 4"):
        in_panels(stack, 4)


def _routed_step(module: Experts, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden, num_experts = module.gate_up_proj.shape[2], module.gate_up_proj.shape[0]
    x = torch.randn(tokens, hidden, generator=generator)
    experts = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:2] for _ in range(tokens)]
    )
    return x, experts, torch.rand(tokens, 2, generator=generator)


def test_packed_experts_give_the_same_bits_until_their_weights_are_written() -> None:
    module = _experts(6, 2 * PANEL, PANEL, seed=4)
    x, experts, weights = _routed_step(module, 9, seed=5)
    with torch.inference_mode():
        in_place = module(x, experts, weights)
        assert pack_model(module) == 4 * (3 * 6 * 2 * PANEL * PANEL)
        assert module.gate_up_panels is not None
        assert module._routed_panels((module.gate_up_proj, module.down_proj))[0].shape == (
            6,
            2,
            2 * PANEL,
            PANEL,
        )
        assert torch.equal(module(x, experts, weights), in_place)
        module.down_proj.mul_(2.0)  # written: the packed copy is stale, the parameters are read
        stacks = module._routed_panels((module.gate_up_proj, module.down_proj))
        assert stacks[1].data_ptr() == module.down_proj.data_ptr()
        doubled = module(x, experts, weights)
        assert torch.allclose(doubled, 2 * in_place, rtol=1e-5, atol=1e-6)
        module.pack_panels()
        assert torch.equal(module(x, experts, weights), doubled)
    assert "gate_up_panels" not in module.state_dict()


def test_experts_pack_only_where_the_routed_kernel_reads_panels() -> None:
    ragged = _experts(3, 96, 48, seed=0)  # 96 columns: wider than a panel, not a multiple
    assert ragged.pack_panels() == 0 and ragged.gate_up_panels is None
    half = _experts(3, PANEL, 48, seed=0)  # down packs, gate_up (96 columns) does not: neither
    assert half.pack_panels() == 0 and half.down_panels is None
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert pack_model(_experts(3, PANEL, PANEL, seed=0)) == 0  # threads: not routed
    finally:
        torch.set_num_threads(previous)


def test_a_graph_captured_on_packed_experts_replays_like_eager() -> None:
    module = _experts(5, PANEL, PANEL // 2, seed=2)
    module.pack_panels()
    x, experts, weights = _routed_step(module, 6, seed=3)
    static = StaticMemory()
    static.register_many((x, experts, weights), "inputs")
    static.register_module(module, "experts")  # as a runner registers its model
    with torch.inference_mode():
        with BreakableCapture(TapeBackend(), static=static) as capture:  # audited
            out = module(x, experts, weights)
        for seed in (6, 7):
            fresh_x, fresh_experts, _ = _routed_step(module, 6, seed)
            x.copy_(fresh_x)
            experts.copy_(fresh_experts)
            capture.replay()
            assert torch.equal(out, module(x.clone(), experts.clone(), weights))
