"""``dsv4.layers.linear`` and ``GroupedLinear``: up to ``SKINNY_ROWS`` float32 rows on one CPU
thread take the native product (one op; each row's result independent of the rows beside it, so
padding a batch never changes a real row); more rows, more threads or autograd take ATen's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.expert_kernels import swiglu
from dsv4.layers import SKINNY_ROWS, GroupedLinear, linear
from dsv4.moe import SharedExpert
from dsv4.panels import pack_model
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


@given(
    rows=st.integers(1, SKINNY_ROWS),
    leading=st.booleans(),
    in_features=st.integers(1, 300),
    out_features=st.integers(1, 40),
    spread=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_the_native_product_is_within_a_float32_sums_bound_and_rows_are_independent(
    rows: int, leading: bool, in_features: int, out_features: int, spread: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator) * spread
    weight = torch.randn(out_features, in_features, generator=generator)
    shaped = x.view(1, rows, in_features) if leading else x
    with torch.inference_mode():
        got = linear(shaped, weight).view(rows, out_features)
        alone = [linear(x[m : m + 1], weight) for m in range(rows)]
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    # the error bound of a float32 sum of in_features products, in any order
    assert bool(((got.double() - exact).abs() <= in_features * 2**-24 * magnitude).all())
    assert all(torch.equal(got[m : m + 1], row) for m, row in enumerate(alone))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4 * spread)


def test_only_skinny_single_thread_products_are_native() -> None:
    weight = torch.randn(8, 32)

    def ops(x: torch.Tensor) -> dict[str, int]:
        counter = OpCounter()
        with torch.inference_mode(), counter:
            linear(x, weight)
        return dict(counter.by_name)

    assert ops(torch.randn(SKINNY_ROWS, 32))["linear_into"] == 1
    assert "linear_into" not in ops(torch.randn(SKINNY_ROWS + 1, 32))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert "linear_into" not in ops(torch.randn(1, 32))
    finally:
        torch.set_num_threads(previous)
    weight = weight.double()
    assert "linear_into" not in ops(torch.randn(1, 32, dtype=torch.float64))


@given(
    rows=st.integers(1, SKINNY_ROWS),
    groups=st.integers(1, 4),
    in_features=st.integers(1, 70),
    out_features=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_the_grouped_product_is_each_groups_native_product(
    rows: int, groups: int, in_features: int, out_features: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    module = GroupedLinear(in_features, groups * out_features, groups)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
    x = torch.randn(rows, groups, in_features, generator=generator)
    weights = module.weight.view(groups, out_features, in_features)
    counter = OpCounter()
    with torch.inference_mode():
        with counter:
            got = module(x)
        columns = [linear(x[:, g].contiguous(), weights[g]) for g in range(groups)]
        expected = torch.stack(columns, dim=1)
        alone = [module(x[m : m + 1]) for m in range(rows)]
    assert counter.by_name["grouped_linear_into"] == 1
    assert torch.equal(got, expected)
    assert all(torch.equal(got[m : m + 1], row) for m, row in enumerate(alone))
    torch.testing.assert_close(got, torch.einsum("...gi,goi->...go", x, weights))


@given(rows=st.integers(1, 2 * SKINNY_ROWS + 1), seed=st.integers(0, 2**16))
def test_a_packed_shared_expert_is_one_op_equal_to_its_parts(rows: int, seed: int) -> None:
    """With its three weights packed in panels, at any row count on one thread, the shared
    expert's products and its activation are one op (``swiglu_mlp_into``), the same kernels in
    the same order as its parts on the copies: equal bit for bit. Unpacked, it runs the parts
    (for a decode step's rows the dot kernel on the weights), within float32 rounding of it."""
    generator = torch.Generator().manual_seed(seed)
    expert = SharedExpert(40, 64, limit=1.5)
    with torch.no_grad():
        for parameter in expert.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / 4)
    x = torch.randn(rows, 40, generator=generator)
    counter, unpacked = OpCounter(), OpCounter()
    with torch.inference_mode():
        with unpacked:
            apart = expert(x)
        assert pack_model(expert) > 0
        with counter:
            got = expert(x)
        gate, up = expert.gate_proj(x), expert.up_proj(x)  # each one product on its copy
        parts = expert.down_proj(swiglu(gate, up, 1.5))
    assert counter.by_name["swiglu_mlp_into"] == 1 and "swiglu_mlp_into" not in unpacked.by_name
    assert torch.equal(got, parts)
    torch.testing.assert_close(got, apart)
