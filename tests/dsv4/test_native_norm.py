"""``dsv4.layers.rms_norm``: on the CPU one native op (``dsv4::rms_norm_into``) that equals
ATen's ``rms_norm`` but for the last bit of its mean; ATen's wherever autograd records."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.layers import rms_norm
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


@given(
    rows=st.integers(1, 20),
    width=st.integers(1, 700),
    spread=st.sampled_from([1e-3, 1.0, 300.0]),
    eps=st.sampled_from([1e-6, 1e-2]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_native_norm_equals_atens_to_a_rounding_of_the_mean(
    rows: int, width: int, spread: float, eps: float, weighted: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * spread
    weight = torch.randn(width, generator=generator) if weighted else None
    with torch.inference_mode():
        got = rms_norm(x, weight, eps)
    expected = F.rms_norm(x, (width,), weight, eps)
    # a mean one rounding apart moves the scale by half a unit in the last place (2**-23
    # relative at most); with the roundings of the products after it, an output moves by a few
    torch.testing.assert_close(got, expected, rtol=4 * 2**-23, atol=0.0)
    exact = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        exact = exact * weight.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0.0)


def test_one_op_on_the_cpu_atens_where_autograd_records() -> None:
    x, weight = torch.randn(3, 64), torch.randn(64, requires_grad=True)
    counter = OpCounter()
    with torch.inference_mode(), counter:
        out = rms_norm(x, weight, 1e-6)
    assert dict(counter.by_name) == {"empty_like": 1, "rms_norm_into": 1}
    recorded = rms_norm(x, weight, 1e-6)  # grad enabled: ATen's ops, differentiable
    (grad,) = torch.autograd.grad(recorded.sum(), weight)
    torch.testing.assert_close(
        grad, (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)).sum(0)
    )
    torch.testing.assert_close(out, recorded.detach(), rtol=4 * 2**-23, atol=0.0)


def test_a_strided_input_takes_atens_norm() -> None:
    x = torch.randn(64, 5).t()  # not contiguous
    with torch.inference_mode():
        counter = OpCounter()
        with counter:
            got = rms_norm(x, None, 1e-6)
    assert "rms_norm_into" not in counter.by_name
    assert torch.equal(got, F.rms_norm(x, (64,), None, 1e-6))
