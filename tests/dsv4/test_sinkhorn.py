"""``dsv4.hyper.sinkhorn_``: the reference's Sinkhorn rounds, as one operator or unwrapped, and
its native CPU kernel, bit-equal to the rounds as kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.hyper import _sinkhorn_rounds, sinkhorn_
from graphs.op_count import OpCounter

EPS = 1e-6


def _bordered(probs: torch.Tensor) -> torch.Tensor:
    tokens, n, _ = probs.shape
    bordered = torch.full((tokens, n + 1, n + 1), EPS)
    bordered[:, :n, :n] += probs
    return bordered


def _reference(probs: torch.Tensor, iters: int) -> torch.Tensor:
    """The reference's rounds: columns first, each sum plus eps."""
    comb = probs + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    return comb


def test_the_operator_and_the_differentiable_rounds_give_the_reference_and_each_other() -> None:
    logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ones = torch.ones(1, 1, 5)
    with torch.inference_mode():
        operator = _bordered(torch.softmax(logits.detach(), -1))
        sinkhorn_(operator, ones, 20)
    unwrapped = _bordered(torch.softmax(logits, -1))
    sinkhorn_(unwrapped, ones, 20)  # grad enabled: the rounds autograd can follow
    reference = _reference(torch.softmax(logits, -1), 20)
    assert torch.equal(operator, unwrapped.detach())
    torch.testing.assert_close(unwrapped[:, :4, :4], reference, rtol=1e-6, atol=1e-7)
    weights = torch.arange(16.0).view(4, 4)
    (got,) = torch.autograd.grad((unwrapped[:, :4, :4] * weights).sum(), logits)
    (expected,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_the_native_kernels_are_built_by_the_install() -> None:
    assert native.KERNELS is not None, native.reason


@given(
    tokens=st.integers(1, 40),
    n=st.integers(1, 8),
    iters=st.integers(0, 25),
    spread=st.sampled_from([0.1, 1.0, 8.0, 40.0]),
    eps=st.sampled_from([1e-6, 1e-3, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_the_native_kernel_is_bit_equal_to_the_rounds_as_kernels(
    tokens: int, n: int, iters: int, spread: float, eps: float, seed: int
) -> None:
    logits = torch.randn(tokens, n, n, generator=torch.Generator().manual_seed(seed)) * spread
    bordered = torch.full((tokens, n + 1, n + 1), eps)
    bordered[:, :n, :n] += torch.softmax(logits, -1)
    ones = torch.ones(1, 1, n + 1)
    as_kernels, operator = bordered.clone(), bordered.clone()
    _sinkhorn_rounds(as_kernels, ones, iters)
    with torch.inference_mode():
        sinkhorn_(operator, ones, iters)
    assert torch.equal(operator, as_kernels)


def test_a_layout_the_native_kernel_does_not_take_runs_the_rounds_as_kernels() -> None:
    probs = torch.softmax(torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1)), -1)
    ones = torch.ones(1, 1, 5, dtype=torch.float64)
    wide = _bordered(probs).double()
    as_kernels = wide.clone()
    _sinkhorn_rounds(as_kernels, ones, 7)
    with torch.inference_mode():
        sinkhorn_(wide, ones, 7)
    assert torch.equal(wide, as_kernels)
    torch.testing.assert_close(wide[:, :4, :4].float(), _reference(probs, 7))


@pytest.mark.skipif(native.KERNELS is None, reason=native.reason)
def test_the_op_counter_counts_what_the_operator_runs_on_the_device() -> None:
    single, ones = _bordered(torch.full((1, 4, 4), 0.25)), torch.ones(1, 1, 5)
    wide = single.double()
    counter, composite = OpCounter(), OpCounter()
    with torch.inference_mode(), counter:
        sinkhorn_(single, ones, 3)
    assert dict(counter.by_name) == {"sinkhorn_": 1}  # the native kernel: one op
    with torch.inference_mode(), composite:  # float64: the rounds as kernels
        sinkhorn_(wide, ones.double(), 3)
    # 2 * (2 * 3 - 1) kernels: a bmm and a div_ per half-step
    assert composite.by_name["bmm"] == 5
    assert composite.by_name["div_"] == 5
