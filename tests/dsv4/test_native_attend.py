"""``dsv4::attend_into``: the attention core (logits, mask, sink, softmax, weighted sum) in one
native operator equals the composite ``dsv4.attention`` runs elsewhere, within float32 rounding;
a key a token may not see takes no part, even where its row holds NaN."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.attention import attend_takes
from dsv4.native_ops import ATTEND_INTO

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _composite(
    queries: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    logits = torch.einsum("thd,tkd->thk", queries.double(), keys.double()) * scaling
    logits = torch.where(visible.unsqueeze(1), logits, float("-inf"))
    with_sinks = torch.cat((logits, sinks.double().view(1, -1, 1).expand(len(queries), -1, 1)), -1)
    return torch.bmm(with_sinks.softmax(dim=-1)[..., :-1], keys.double())


@given(
    tokens=st.integers(1, 4),
    heads=st.integers(1, 8),
    count=st.integers(1, 40),
    width=st.sampled_from([4, 8, 13, 64]),
    seen=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_attend_equals_the_composite_and_ignores_what_a_token_cannot_see(
    tokens: int, heads: int, count: int, width: int, seen: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(tokens, heads, width, generator=generator)
    keys = torch.randn(tokens, count, width, generator=generator)
    visible = torch.rand(tokens, count, generator=generator) < seen
    sinks = torch.randn(heads, generator=generator)
    scaling = width**-0.5
    expected = _composite(queries, keys, visible, sinks, scaling)
    keys = torch.where(visible.unsqueeze(-1), keys, float("nan"))  # unseen rows hold anything
    out = torch.empty(tokens, heads, width)
    with torch.inference_mode():
        assert attend_takes(out, queries, keys, visible, sinks)
        ATTEND_INTO(out, queries, keys, visible, sinks, scaling)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_attend_is_native_only_for_contiguous_float32_on_one_thread() -> None:
    queries, keys = torch.randn(1, 2, 8), torch.randn(1, 3, 8)
    visible, sinks, out = torch.ones(1, 3, dtype=torch.bool), torch.zeros(2), torch.empty(1, 2, 8)
    with torch.inference_mode():
        assert attend_takes(out, queries, keys, visible, sinks)
        assert not attend_takes(out, queries.double(), keys, visible, sinks)
        assert not attend_takes(out, queries, keys.transpose(1, 2), visible, sinks)
        assert not attend_takes(out, queries, keys, visible.int(), sinks)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert not attend_takes(out, queries, keys, visible, sinks)
        finally:
            torch.set_num_threads(previous)
