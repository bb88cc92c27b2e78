"""``dsv4::attend_into``: the attention core (keys read in place from their tables by row,
logits, mask, sink, softmax, weighted sum) in one native op equals the composite
``dsv4.attention`` runs elsewhere (gather, mask, concatenate, softmax, product) within float32
rounding; a key a token may not see takes no part, even where its row holds NaN or its index
points anywhere; a seen row outside its table is refused. On float32 copies of narrow queries and
keys, rounding where the composite rounds (``rounding``), it gives the narrow composite's bits."""

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


def _narrow_composite(
    queries: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The attention core as ``dsv4.attention`` composes it in a narrow dtype: the product and
    its scaling in that dtype, the softmax (with the float32 sinks) in float32, its weights
    rounded to the dtype for the weighted sum."""
    logits = torch.einsum("thd,tkd->thk", queries, keys) * scaling
    logits = torch.where(visible.unsqueeze(1), logits, float("-inf"))
    sinks = sinks.view(1, -1, 1).expand(len(queries), -1, 1)
    probs = torch.cat((logits.float(), sinks), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.bmm(probs.to(keys.dtype), keys)


@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    heads=st.integers(2, 4),
    window=st.integers(1, 20),
    width=st.sampled_from([8, 13, 64]),
    seed=st.integers(0, 2**16),
)
def test_rounding_to_a_narrow_dtype_gives_the_narrow_composites_bits(
    dtype: torch.dtype, heads: int, window: int, width: int, seed: int
) -> None:
    """Small integers make every product and sum exact in any order, so what remains is where
    each side rounds: the same points, hence the same bits (an element may still differ by one
    unit where ATen's float32 exp and the kernel's straddle a rounding boundary, which moves a
    head's whole row: at least 90% are bit-equal, 94.7% at the least of 3,000 draws). Without
    ``rounding`` half the draws have less than 53% bit-equal."""
    generator = torch.Generator().manual_seed(seed)
    tokens = 8
    queries = torch.randint(-4, 5, (tokens, heads, width), generator=generator).to(dtype)
    keys = torch.randint(-4, 5, (tokens, window, width), generator=generator).to(dtype)
    seen = torch.rand(tokens, window, generator=generator) < 0.8
    seen[:, 0] = True
    sinks = torch.randn(heads, generator=generator)
    scaling = width**-0.5
    expected = _narrow_composite(queries, keys, seen, sinks, scaling)
    out = torch.empty(tokens, heads, width)
    in_order = torch.arange(tokens * window).view(tokens, window)
    wide_keys = keys.reshape(-1, width).float()
    with torch.inference_mode():
        ATTEND_INTO(
            out, queries.float(), wide_keys, in_order, seen, None, None, None, sinks, scaling, dtype
        )
    got = out.to(dtype)
    assert float((got == expected).float().mean()) >= 0.9
    unit = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), expected.float(), rtol=unit, atol=unit)


def test_rounding_takes_only_a_narrow_dtype() -> None:
    queries, table, sinks = torch.randn(1, 1, 8), torch.randn(2, 8), torch.zeros(1)
    rows, seen = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    out = torch.empty(1, 1, 8)
    with torch.inference_mode(), pytest.raises(ValueError, match="rounding None"):
        ATTEND_INTO(out, queries, table, rows, seen, None, None, None, sinks, 1.0, torch.float64)
