"""The eager-region strategies: a chain with ``join`` as least upper bound, and ``compose``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import (
    STRATEGIES,
    BreakableCapture,
    EagerRegionStrategy,
    FullGraph,
    NarrowRegion,
    NoGraph,
    WideRegion,
    strategy_from_name,
)

strategies = st.sampled_from(STRATEGIES)


def test_the_chain_order_and_names() -> None:
    assert FullGraph() < NarrowRegion() < WideRegion() < NoGraph()
    assert [s.name for s in STRATEGIES] == ["full-graph", "narrow", "wide", "no-graph"]
    assert all(strategy_from_name(s.name) == s for s in STRATEGIES)


@given(strategies, strategies, strategies)
def test_join_is_the_least_upper_bound(
    a: EagerRegionStrategy, b: EagerRegionStrategy, c: EagerRegionStrategy
) -> None:
    joined = a.join(b)
    assert joined == b.join(a)
    assert joined.covers(a) and joined.covers(b)
    assert joined in (a, b)
    assert a.join(b).join(c) == a.join(b.join(c))
    assert a.join(a) == a
    assert a.join(FullGraph()) == a
    assert a.join(NoGraph()) == NoGraph()


@given(strategies)
def test_strategies_are_values(a: EagerRegionStrategy) -> None:
    same = type(a)()
    assert same == a and hash(same) == hash(a)
    assert {a, same} == {a}


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="full-graph, narrow, wide, no-graph"):
        strategy_from_name("medium")


def _prepare(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tanh(x) * 3, out


def _attend(prepared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, out = prepared
    out.copy_(torch.softmax(q, dim=-1))
    return out


@given(strategies, st.integers(min_value=0, max_value=2**31 - 1))
def test_every_strategy_computes_attend_after_prepare_eagerly(
    strategy: EagerRegionStrategy, seed: int
) -> None:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed))
    reference = torch.softmax(torch.tanh(x) * 3, dim=-1)
    out = torch.empty(3, 5)
    assert torch.equal(strategy.compose(_prepare, _attend)(x, out), reference)


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [(FullGraph(), "G"), (NarrowRegion(), "GE"), (WideRegion(), "E"), (NoGraph(), "E")],
)
def test_break_layout_of_each_strategy(strategy: EagerRegionStrategy, layout: str) -> None:
    x = torch.zeros(2, 4)
    out = torch.empty(2, 4)
    region = strategy.compose(_prepare, _attend)
    with BreakableCapture(device="cpu") as capture:
        region(x, out)
    assert capture.layout == layout
    x.copy_(torch.arange(8, dtype=torch.float32).reshape(2, 4))
    capture.replay()
    assert torch.equal(out, torch.softmax(torch.tanh(x) * 3, dim=-1))
