"""``dsv4.hyper.sinkhorn_``: the reference's Sinkhorn rounds, as one operator or unwrapped."""

from __future__ import annotations

import torch

from dsv4.hyper import sinkhorn_
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


def test_the_op_counter_counts_the_kernels_the_operator_runs() -> None:
    bordered, ones = _bordered(torch.full((1, 4, 4), 0.25)), torch.ones(1, 1, 5)
    counter = OpCounter()
    with torch.inference_mode(), counter:
        sinkhorn_(bordered, ones, 3)
    # 2 * (2 * 3 - 1) kernels: a bmm and a div_ per half-step
    assert counter.by_name["bmm"] == 5
    assert counter.by_name["div_"] == 5
