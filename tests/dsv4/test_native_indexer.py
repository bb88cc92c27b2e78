"""``dsv4::index_scores_into``: the lightning indexer's scores in one native op select what the
composite (``einsum``, ReLU, scale, head weights, mask) selects, and score within float32
rounding of it; a call whose shapes disagree is refused before the kernel reads anything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.indexer import Indexer
from dsv4.native_ops import INDEX_SCORES_INTO
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


@given(
    tokens=st.integers(1, 3),
    heads=st.integers(1, 4),
    count=st.integers(1, 30),
    width=st.sampled_from([4, 16, 21]),
    seen=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_native_scores_equal_the_composite(
    tokens: int, heads: int, count: int, width: int, seen: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(tokens, heads, width, generator=generator)
    keys = torch.randn(tokens, count, width, generator=generator)
    weights = torch.randn(tokens, heads, generator=generator)
    visible = torch.rand(tokens, count, generator=generator) < seen
    exact = torch.einsum("thd,tsd->ths", queries.double(), keys.double()).relu()
    expected = (exact * width**-0.5 * weights.double().unsqueeze(-1)).sum(dim=1)
    expected = torch.where(visible, expected, float("-inf"))
    got = torch.empty(tokens, count)
    with torch.inference_mode():
        INDEX_SCORES_INTO(got, queries, keys, weights, visible, width**-0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_indexer_selects_alike_natively_and_by_the_composite() -> None:
    indexer = Indexer(32, 16, num_heads=4, head_dim=16, rate=4, topk=5, eps=1e-6)
    generator = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(3, 4, 16, generator=generator), torch.randn(3, 20, 16)
    weights, visible = torch.randn(3, 4, generator=generator), torch.rand(3, 20) > 0.3
    counter = OpCounter()
    with torch.inference_mode(), counter:
        native_choice = indexer.select(queries, weights, keys, visible)
    assert counter.by_name["index_scores_into"] == 1
    assert torch.equal(native_choice, indexer.select(queries, weights, keys, visible))
    with torch.inference_mode(), pytest.raises(ValueError, match="index_scores_into"):
        indexer.select(queries, keys, weights, visible)  # keys and weights swapped
