"""``dsv4::pool_into``: a compressor's window pooling (gather, per-channel softmax of the gate,
weighted sum) in one native op equals the composite within float32 rounding; a masked slot takes
no part (even where its rows hold NaN); a channel whose every slot is masked pools NaN, as the
composite's softmax does; an index outside the tables is refused and writes nothing. On float32
copies of a narrow cache, rounding where the composite rounds (``rounding``), it gives the narrow
composite's bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.native_ops import POOL_INTO

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _composite(
    kv: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor | None
) -> torch.Tensor:
    kv_w, gate_w = kv.double()[rows], gate.double()[rows]
    if masked is not None:
        gate_w = torch.where(masked.unsqueeze(-1), float("-inf"), gate_w)
    return (kv_w * gate_w.softmax(dim=1)).sum(dim=1)


@given(
    tokens=st.integers(1, 4),
    span=st.integers(1, 8),
    count=st.integers(1, 12),
    width=st.integers(1, 20),
    with_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_pooling_equals_the_composite(
    tokens: int, span: int, count: int, width: int, with_mask: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(count, width, generator=generator)
    gate = torch.randn(count, width, generator=generator) * 3
    rows = torch.randint(0, count, (tokens, span), generator=generator)
    masked = torch.rand(tokens, span, generator=generator) < 0.3 if with_mask else None
    expected = _composite(kv, gate, rows, masked)
    got = torch.empty(tokens, width)
    with torch.inference_mode():
        POOL_INTO(got, kv, gate, rows, masked)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_masked_rows_holding_nan_take_no_part_and_an_all_masked_window_pools_nan() -> None:
    kv = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")], [3.0, 5.0]])
    gate = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [0.0, 0.0]])
    rows = torch.tensor([[0, 1, 2], [1, 1, 1]])
    masked = torch.tensor([[False, True, False], [True, True, True]])
    got = torch.empty(2, 2)
    with torch.inference_mode():
        POOL_INTO(got, kv, gate, rows, masked)
    weights = torch.tensor([[0.0, 1.0], [0.0, 0.0]]).softmax(dim=0)
    torch.testing.assert_close(got[0], (kv[[0, 2]] * weights).sum(dim=0))
    assert bool(got[1].isnan().all())
    with torch.inference_mode(), pytest.raises(IndexError, match="index out of range"):
        POOL_INTO(got, kv, gate, rows + 3, None)
    assert bool(got[1].isnan().all())  # untouched


@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    tokens=st.integers(4, 8),
    span=st.integers(2, 8),
    width=st.integers(8, 20),
    seed=st.integers(0, 2**16),
)
def test_rounding_to_a_narrow_dtype_gives_the_narrow_composites_bits(
    dtype: torch.dtype, tokens: int, span: int, width: int, seed: int
) -> None:
    """``dsv4.pooling``'s narrow composite (float32 softmax of float32 gates, its weights
    rounded, each weighted row rounded, the sum rounded once) against the kernel on float32
    copies with ``rounding``: the same points, the same bits (all of them in 3,000 draws; an
    element may still differ by one unit where ATen's float32 exp and the kernel's straddle a
    rounding boundary). Without ``rounding`` at most 84% of them are bit-equal."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, span, width, generator=generator).to(dtype)
    gate = torch.randn(tokens, span, width, generator=generator) * 3
    weights = gate.softmax(dim=1, dtype=torch.float32).to(dtype)
    expected = (kv * weights).sum(dim=1)
    got = torch.empty(tokens, width)
    in_order = torch.arange(tokens * span).view(tokens, span)
    with torch.inference_mode():
        POOL_INTO(got, kv.view(-1, width).float(), gate.view(-1, width), in_order, None, dtype)
    narrow = got.to(dtype)
    assert float((narrow == expected).float().mean()) >= 0.9
    unit = torch.finfo(dtype).eps
    torch.testing.assert_close(narrow.float(), expected.float(), rtol=unit, atol=unit)
