"""The native SwiGLU and rotary ops (``dsv4.native_ops``) against ATen's ops that compute the
same: the rotation bit for bit (the same three roundings), the SwiGLU to its exp's last place;
and ``row_stride``, which decides what the kernels may read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.config import YarnScaling
from dsv4.expert_kernels import swiglu, swiglu_of
from dsv4.native_ops import row_stride
from dsv4.rope import RotaryEmbedding
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _aten_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@given(
    leading=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    width=st.integers(1, 70),
    limit=st.sampled_from([0.5, 7.0, 1e30]),
    spread=st.sampled_from([0.1, 3.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_the_native_swiglu_equals_atens_on_halves_of_one_product(
    leading: list[int], width: int, limit: float, spread: float, seed: int
) -> None:
    gate_up = torch.randn(*leading, 2 * width, generator=torch.Generator().manual_seed(seed))
    gate_up = gate_up * spread
    gate_up.view(-1)[0] = float("nan")
    with torch.inference_mode():
        got = swiglu_of(gate_up, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = _aten_swiglu(gate, up, limit)
    torch.testing.assert_close(got, expected, rtol=4 * 2**-23, atol=1e-37, equal_nan=True)


def test_the_swiglu_is_one_op_and_atens_where_rows_do_not_collapse() -> None:
    gate_up = torch.randn(3, 4, 16)
    counter = OpCounter()
    with torch.inference_mode(), counter:
        swiglu_of(gate_up, 2.0)
    assert counter.by_name["swiglu_into"] == 1 and "silu" not in counter.by_name
    gate, up = torch.randn(8, 6).t(), torch.randn(6, 8)  # gate's rows are columns: ATen's
    with torch.inference_mode(), counter:
        got = swiglu(gate, up, 2.0)
    assert counter.by_name["swiglu_into"] == 1 and counter.by_name["silu"] == 1
    assert torch.equal(got, _aten_swiglu(gate, up, 2.0))


@given(
    heads=st.sampled_from([None, 1, 3]),
    tokens=st.integers(1, 7),
    pairs=st.integers(1, 8),
    keep=st.integers(0, 6),
    scaled=st.booleans(),
    inverse=st.booleans(),
    narrower=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_native_rotation_is_bit_equal_to_atens(
    heads: int | None,
    tokens: int,
    pairs: int,
    keep: int,
    scaled: bool,
    inverse: bool,
    narrower: bool,
    seed: int,
) -> None:
    width = keep + 2 * pairs
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16) if scaled else None
    widths = (width, width + 2) if narrower else (width,)
    rope = RotaryEmbedding(2 * pairs, 10_000.0, yarn, widths)
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens, 1), generator=generator)
    shape = (tokens, width) if heads is None else (tokens, heads, width)
    x = torch.randn(shape, generator=generator)
    tables = rope.tables(positions, torch.float32).last(width)
    if heads is not None:
        tables = tables.per_head()
    with torch.inference_mode():
        counter = OpCounter()
        with counter:
            got = rope.rotate(x, tables, inverse=inverse)
    assert counter.by_name["rope_into"] == 1
    expected = rope.rotate(x, tables, inverse=inverse)  # autograd on: ATen's three kernels
    assert torch.equal(got, expected)


def test_row_stride_collapses_evenly_spaced_rows_only() -> None:
    block = torch.zeros(3, 4, 10)
    assert row_stride(block, 12) == 10
    assert row_stride(block[..., :5], 12) == 10  # the first half of each row
    assert row_stride(block[:, :2], 6) is None  # rows 4 apart within a block, 40 across
    assert row_stride(block.transpose(0, 1), 12) is None
    assert row_stride(torch.zeros(1, 1, 7), 1) == 7
    assert row_stride(torch.zeros(5, 1).expand(5, 4), 5) is None  # stride 0 in the last axis
    assert row_stride(torch.zeros(1, 4).expand(3, 4), 3) is None  # rows overlap
    assert row_stride(block.double(), 12) is None
