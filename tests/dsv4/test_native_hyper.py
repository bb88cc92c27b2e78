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
from dsv4.layers import SKINNY_ROWS, rms_norm
from dsv4.native_ops import HC_COLLAPSE_INTO, HC_WEIGHTS_INTO, LINEAR_PANELS_INTO
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


@pytest.mark.parametrize("tokens", [1, SKINNY_ROWS, SKINNY_ROWS + 1, 70])
def test_a_packed_hyper_connection_is_one_native_op_and_the_mix_one(tokens: int) -> None:
    """With ``fn`` packed in panels, at any token count on one thread, the norm, the mixing
    logits' product, the weights and the collapse are one op (``hc_pre_into``), equal bit for
    bit to the four native ops it runs in order (the product on the copy in panels). Unpacked,
    a step issues those four ops, the product on ``fn`` itself."""
    hc, output = _hyper(4, 32, 20, 0.5, 0), torch.randn(tokens, 32)
    streams = torch.randn(tokens, 4, 32)
    counter, mixing, unpacked = OpCounter(), OpCounter(), OpCounter()
    with torch.inference_mode():
        with unpacked:
            hc(streams)
        assert hc.pack_panels() > 0 and hc.fn_panels is not None
        with counter:
            post, comb_t, collapsed = hc(streams)
        with mixing:
            mix(streams, post, comb_t, output)
        flat = rms_norm(streams.flatten(1), None, hc.norm_eps)
        logits = torch.empty(tokens, hc.fn.shape[0])
        LINEAR_PANELS_INTO(logits, flat, hc.fn_panels)
        pre, post_apart = torch.empty(tokens, 4), torch.empty(tokens, 4)
        bordered, collapsed_apart = torch.empty(tokens, 5, 5), torch.empty(tokens, 32)
        HC_WEIGHTS_INTO(pre, post_apart, bordered, logits, hc.scale, hc.base, hc.eps, 20)
        HC_COLLAPSE_INTO(collapsed_apart, pre, streams)
    assert {k: v for k, v in counter.by_name.items() if k not in _VIEWS_AND_EMPTY} == {
        "hc_pre_into": 1
    }
    assert torch.equal(post, post_apart) and torch.equal(collapsed, collapsed_apart)
    assert torch.equal(comb_t, bordered[:, :4, :4].transpose(1, 2))
    assert {k: v for k, v in mixing.by_name.items() if k not in _VIEWS_AND_EMPTY} == {
        "hc_mix_into": 1
    }
    apart = {"rms_norm_into", "hc_weights_into", "hc_collapse_into"}
    product = "linear_into" if tokens <= SKINNY_ROWS else "mm"
    assert apart | {product} <= set(unpacked.by_name)


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
