"""The hyper-connections' native CPU ops (``dsv4.native_ops``: the mixing weights, the collapse
and the mix, one op each) against ATen's ops that compute the same (the path every other device
takes, and the CPU takes wherever autograd records: it is what the transformers oracle tests
check): drawn widths, stream counts, token counts, rounds and parameter scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.hyper import HyperConnection, HyperHead, mix
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _hyper(n: int, hidden: int, iters: int, spread: float, seed: int) -> HyperConnection:
    generator = torch.Generator().manual_seed(seed)
    hc = HyperConnection(n, hidden, sinkhorn_iters=iters, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        for parameter in (hc.fn, hc.base, hc.scale):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * spread)
    return hc


@given(
    n=st.integers(1, 6),
    hidden=st.integers(1, 96),
    tokens=st.integers(1, 9),
    iters=st.integers(1, 24),
    spread=st.sampled_from([0.05, 0.5, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_the_native_mixing_weights_collapse_and_mix_equal_atens(
    n: int, hidden: int, tokens: int, iters: int, spread: float, seed: int
) -> None:
    hc = _hyper(n, hidden, iters, spread, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    streams = torch.randn(tokens, n, hidden, generator=generator)
    output = torch.randn(tokens, hidden, generator=generator)
    with torch.inference_mode():
        native = hc(streams)
        mixed = mix(streams, native[0], native[1], output)
    reference = [t.detach() for t in hc(streams)]  # autograd records: ATen's ops
    # up to 4 tokens the mixing logits come from the native product, which sums in another
    # order than MKL's; the softmax and the Sinkhorn rounds carry that difference along
    for got, want in zip(native, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the mix, against the exact sum of its float32 terms: within the error bound of a sum of
    # n + 1 products in float32, (n + 2) units of 2**-24 of the sum of their magnitudes
    post, comb_t = native[0].double(), native[1].double()
    spread_term = post.unsqueeze(-1) * output.double().unsqueeze(-2)
    carried = torch.bmm(comb_t, streams.double())
    magnitude = spread_term.abs() + torch.bmm(comb_t.abs(), streams.double().abs())
    bound = (n + 2) * 2**-24 * magnitude
    assert bool(((mixed.double() - (spread_term + carried)).abs() <= bound).all())
    aten = mix(streams, native[0].clone(), native[1].clone(), output)  # autograd on: ATen's
    assert bool(((aten.double() - (spread_term + carried)).abs() <= bound).all())


def test_a_hyper_connection_is_four_native_ops_and_the_mix_one() -> None:
    hc, streams, output = _hyper(4, 32, 20, 0.5, 0), torch.randn(2, 4, 32), torch.randn(2, 32)
    counter, mixing = OpCounter(), OpCounter()
    with torch.inference_mode():
        with counter:
            post, comb_t, _ = hc(streams)
        with mixing:
            mix(streams, post, comb_t, output)
    kernels = {k: v for k, v in counter.by_name.items() if k not in _VIEWS_AND_EMPTY}
    # the mixing logits' product of 2 rows is the native skinny one (dsv4.layers.linear)
    assert kernels == {
        "rms_norm_into": 1,
        "linear_into": 1,
        "hc_weights_into": 1,
        "hc_collapse_into": 1,
    }
    assert {k: v for k, v in mixing.by_name.items() if k not in _VIEWS_AND_EMPTY} == {
        "hc_mix_into": 1
    }


_VIEWS_AND_EMPTY = frozenset({"view", "t", "slice", "transpose", "empty_like", "new_empty"})


def test_the_head_collapses_natively_as_aten_does() -> None:
    head = HyperHead(4, 48, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        head.hc_fn.normal_(0, 0.3)
        head.hc_base.normal_()
    streams = torch.randn(5, 4, 48)
    with torch.inference_mode():
        native = head(streams)
    torch.testing.assert_close(native, head(streams).detach(), rtol=2e-6, atol=1e-6)
