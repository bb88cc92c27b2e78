"""``dsv4::attend_into``: the attention core (keys read in place from their tables by row,
logits, mask, sink, softmax, weighted sum) in one native op equals the composite
``dsv4.attention`` runs elsewhere (gather, mask, concatenate, softmax, product) within float32
rounding; a key a token may not see takes no part, even where its row holds NaN or its index
points anywhere; a seen row outside its table is refused."""

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
    keys = torch.where(visible.unsqueeze(-1), keys.double(), 0.0)
    return torch.bmm(with_sinks.softmax(dim=-1)[..., :-1], keys)


@given(
    tokens=st.integers(1, 4),
    heads=st.integers(1, 8),
    window=st.integers(1, 20),
    per_entries=st.integers(0, 12),
    width=st.sampled_from([4, 8, 13, 64]),
    seen=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_attend_equals_the_composite_and_ignores_what_a_token_cannot_see(
    tokens: int, heads: int, window: int, per_entries: int, width: int, seen: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(tokens, heads, width, generator=generator)
    table = torch.randn(30, width, generator=generator)
    table[29] = float("nan")  # a row nobody may see
    rows = torch.randint(0, 29, (tokens, window), generator=generator)
    key_seen = torch.rand(tokens, window, generator=generator) < seen
    rows = torch.where(key_seen, rows, 29)
    entries = torch.randn(10, width, generator=generator)
    entry_rows = torch.randint(0, 10, (tokens, per_entries), generator=generator)
    entry_seen = torch.rand(tokens, per_entries, generator=generator) < seen
    entry_rows = torch.where(entry_seen, entry_rows, 10**9)  # unseen: points anywhere
    sinks = torch.randn(heads, generator=generator)
    scaling = width**-0.5
    keys = torch.cat((table[rows], entries[entry_rows.clamp(max=9)]), dim=1)
    visible = torch.cat((key_seen, entry_seen), dim=1)
    expected = _composite(queries, keys, visible, sinks, scaling)
    out = torch.empty(tokens, heads, width)
    parts = (table, rows, key_seen, entries, entry_rows, entry_seen)
    with torch.inference_mode():
        assert attend_takes(out, queries, sinks, *parts)
        ATTEND_INTO(out, queries, *parts, sinks, scaling)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_seen_row_outside_its_table_is_refused() -> None:
    queries, table, sinks = torch.randn(1, 2, 8), torch.randn(3, 8), torch.zeros(2)
    out = torch.full((1, 2, 8), 7.0)
    seen = torch.ones(1, 2, dtype=torch.bool)
    with torch.inference_mode(), pytest.raises(IndexError, match="index out of range"):
        ATTEND_INTO(out, queries, table, torch.tensor([[0, 3]]), seen, None, None, None, sinks, 1.0)
    assert bool((out == 7.0).all())


def test_attend_is_native_only_for_contiguous_float32_on_one_thread() -> None:
    queries, table, sinks = torch.randn(1, 2, 8), torch.randn(3, 8), torch.zeros(2)
    rows, seen, out = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), None
    out = torch.empty(1, 2, 8)
    parts = (table, rows, seen, None, None, None)
    with torch.inference_mode():
        assert attend_takes(out, queries, sinks, *parts)
        assert not attend_takes(out, queries.double(), sinks, *parts)
        strided = torch.zeros(1, 6, dtype=torch.long)[:, ::2]
        assert not attend_takes(out, queries, sinks, table, strided, seen, None, None, None)
        assert not attend_takes(out, queries, sinks, table, rows, seen.int(), None, None, None)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert not attend_takes(out, queries, sinks, *parts)
        finally:
            torch.set_num_threads(previous)
