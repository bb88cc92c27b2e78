"""The tape replays the native operators as bound calls (``graphs.bound_kernels``): the kernel
on the addresses fixed at capture, as a CUDA graph replays a launch, reading the values there
at replay; equal bit for bit to running the ops again, and holding the memory it addresses."""

from __future__ import annotations

import gc

import pytest
import torch

from dsv4 import native
from dsv4.expert_kernels import swiglu_of
from dsv4.hyper import HyperConnection, mix
from dsv4.layers import rms_norm
from graphs import BreakableCapture, TapeBackend
from graphs.tape import TapeSegment

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)


def _program(
    hc: HyperConnection, streams: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    post, comb_t, collapsed = hc(streams)
    normed = rms_norm(collapsed, weight, 1e-6)
    hidden = swiglu_of(gate_up, 4.0)
    return mix(streams, post, comb_t, normed + hidden)


def test_native_ops_replay_bound_to_their_addresses_and_equal_eager() -> None:
    generator = torch.Generator().manual_seed(0)
    hc = HyperConnection(4, 16, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=generator) * 0.1)
    assert hc.pack_panels() > 0  # its norm, product, weights and collapse: one op
    streams, gate_up = torch.randn(3, 4, 16, generator=generator), torch.randn(3, 32)
    weight = torch.randn(16, generator=generator)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = _program(hc, streams, gate_up, weight)
        (segment,) = capture.segments
        assert isinstance(segment, TapeSegment)
        bound = [step for step in segment._steps if hasattr(step, "tensors")]
        # the hyper-connection (one op on its copy in panels), rms norm, swiglu, mix
        assert len(bound) == 4
        for seed in (1, 2):
            streams.copy_(torch.randn(3, 4, 16, generator=generator) * seed)
            gate_up.copy_(torch.randn(3, 32, generator=generator))
            gc.collect()  # nothing a bound call addresses may have been freed
            capture.replay()
            assert torch.equal(out, _program(hc, streams.clone(), gate_up.clone(), weight))
