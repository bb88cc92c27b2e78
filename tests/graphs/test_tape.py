"""Mechanics of the tape: which ops replay how, frozen scalars, memory, and misuse.

Every test compares replay after new inputs against an eager run on those inputs, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from graphs import BreakableCapture, CaptureError, TapeBackend, eager_break_during_capture
from graphs.tape import TapeSegment

Program = Callable[[torch.Tensor], torch.Tensor]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def replays_like_eager(program: Program, shape: tuple[int, ...] = (4, 6), replays: int = 3) -> None:
    """Capture ``program`` on a static input, then replay on new inputs against eager runs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = program(x)
        for _ in range(replays):
            x.copy_(torch.randn(shape, generator=generator))
            capture.replay()
            expected = program(x.clone())
            assert torch.equal(_bits(out), _bits(expected)), (out - expected).abs().max()


# Ops whose out= overload a naive `.out` lookup gets wrong, multi-output ops, ops without any
# out= form (replayed by running the op and copying), copies and factories.
OPS: dict[str, Program] = {
    "pow-scalar-exponent": lambda x: x.pow(2),
    "pow-scalar-base": lambda x: torch.pow(2.0, x),
    "pow-tensors": lambda x: x.abs().pow(x),
    "le": lambda x: (x.le(0.25)).to(x.dtype),
    "where-scalar": lambda x: torch.where(x > 0, x, 0.5),
    "where-tensors": lambda x: torch.where(x > 0, x, -x),
    "softmax-dtype": lambda x: torch.softmax(x, -1, dtype=torch.float64).float(),
    "index": lambda x: x[torch.arange(3, 0, -2)],
    "max-dim": lambda x: x.max(dim=1).values + x.max(dim=1).indices,
    "topk": lambda x: torch.topk(x, 2).values.sum(-1, keepdim=True) * x,
    "sort": lambda x: torch.sort(x, dim=0).values,
    "var_mean": lambda x: torch.stack(torch.var_mean(x, dim=1)),
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (6,)),
    "reshape-copy": lambda x: x.t().reshape(-1),
    "to-double": lambda x: x.to(torch.float64).sin().float(),
    "arange": lambda x: x * torch.arange(6),
    "full-mutated": lambda x: torch.full((4, 6), 2.0).mul_(x),
    "literal-mutated": lambda x: x * torch.tensor(1.5).add_(x[0, 0]),
    "split": lambda x: sum(x.split(2, dim=1)),
    "unbind-cat": lambda x: torch.cat(x.unbind(0)),
    "rms_norm": lambda x: torch.rms_norm(x, (6,), torch.linspace(0.5, 1.5, 6), 1e-6),
    "einsum": lambda x: torch.einsum("ij,kj->ik", x, x.flip(0)),
    "linear": lambda x: torch.nn.functional.linear(x, x[:2].flip(1), torch.arange(2.0)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_replays_like_eager(name: str) -> None:
    replays_like_eager(OPS[name])  # type: ignore[arg-type]


def test_in_place_view_ops_keep_the_metadata_each_use_saw() -> None:
    """``t`` is transposed in place between uses and stays alive (so it is not re-homed)."""
    held: list[torch.Tensor] = []

    def program(x: torch.Tensor) -> torch.Tensor:
        t = x * 2.0
        before = t.sum(dim=1)
        t.t_()
        t.mul_(torch.arange(4.0))
        t.unsqueeze_(0)
        held.append(t)
        return t.squeeze(0).sum(dim=0) + before

    replays_like_eager(program)
    assert held[0].shape == (1, 6, 4)


def test_a_factory_output_an_eager_break_mutates_is_refilled_every_replay() -> None:
    @eager_break_during_capture
    def accumulate(buffer: torch.Tensor, y: torch.Tensor) -> None:
        buffer.add_(y)

    def program(x: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(4, 6)
        accumulate(buffer, x)
        return buffer * 2.0

    replays_like_eager(program)


def test_constant_factories_and_literals_are_kept_not_replayed() -> None:
    x = torch.randn(4)
    with torch.inference_mode(), BreakableCapture(TapeBackend()) as capture:
        out = x * torch.arange(4.0) + torch.tensor(1.0)
    (segment,) = capture.segments
    assert isinstance(segment, TapeSegment)
    assert segment.num_steps == 2 and segment.memory.constant_bytes == 16 + 4
    x.fill_(2.0)
    capture.replay()
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0, 7.0]))


def test_user_out_arguments_are_rewritten_on_replay() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(4, 6)
        torch.add(x, 1.0, out=out)
        torch.mul(out, x, out=out)
        return out

    replays_like_eager(program)


def test_python_scalars_and_shapes_are_frozen_at_capture() -> None:
    """A host value read before the capture is baked in, as a CUDA graph bakes it."""
    x = torch.ones(4)
    scale = 3.0
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = x * scale
        scale = 5.0
        x.fill_(2.0)
        capture.replay()
    assert scale == 5.0
    assert torch.equal(out, torch.full((4,), 6.0))


def test_replay_works_outside_inference_mode_and_under_no_grad_capture() -> None:
    x = torch.randn(3, 3)
    with torch.no_grad(), BreakableCapture(TapeBackend()) as capture:
        out = torch.softmax(x @ x.t(), dim=-1)
    x.copy_(torch.randn(3, 3))
    capture.replay()
    assert torch.equal(out, torch.softmax(x @ x.t(), dim=-1))


def test_views_are_not_replayed_and_replay_is_one_call_per_op() -> None:
    x = torch.randn(4, 6)
    with torch.inference_mode(), BreakableCapture(TapeBackend()) as capture:
        out = x.t()[1:].unsqueeze(0).expand(2, 5, 4) + 1.0
    (segment,) = capture.segments
    assert isinstance(segment, TapeSegment)
    assert segment.num_ops == 5 and segment.num_steps == 1
    x.fill_(1.0)
    capture.replay()
    assert torch.equal(out, torch.full((2, 5, 4), 2.0))


def test_composite_ops_are_recorded_as_the_ops_eager_runs_for_them() -> None:
    """``linear`` has no CPU kernel of its own: eager runs ``t`` (a view) and ``mm``, and the
    tape records those (``matmul`` is composite too), so the replay is one ``mm`` into the
    output, not a run and a copy."""
    x, w = torch.randn(4, 6), torch.randn(3, 6)
    with torch.inference_mode(), BreakableCapture(TapeBackend()) as capture:
        out = torch.nn.functional.linear(x, w)
    (segment,) = capture.segments
    assert isinstance(segment, TapeSegment)
    assert (segment.num_ops, segment.num_steps) == (4, 1)  # linear, t, matmul, mm: one step
    x.copy_(torch.randn(4, 6))
    capture.replay()
    assert torch.equal(out, torch.nn.functional.linear(x, w))


def test_dropped_intermediates_share_an_arena_and_only_held_tensors_are_retained() -> None:
    n, width = 16, 64
    x = torch.randn(width, width)
    nbytes = width * width * 4
    with torch.inference_mode(), BreakableCapture(TapeBackend()) as capture:
        h = x
        for _ in range(n):
            h = torch.tanh(h @ x)
        out = h
    (segment,) = capture.segments
    assert isinstance(segment, TapeSegment)
    memory = segment.memory
    assert memory.internal_bytes == (2 * n - 1) * nbytes  # every matmul and tanh but `out`
    assert memory.arena_bytes <= 2 * nbytes  # two alive at a time
    assert memory.retained_bytes == nbytes  # `out`
    x.copy_(torch.randn(width, width))
    capture.replay()
    expected = x
    for _ in range(n):
        expected = torch.tanh(expected @ x)
    assert torch.equal(out, expected)


def test_segments_of_one_backend_share_the_arena() -> None:
    backend = TapeBackend()
    x = torch.randn(32, 32)
    outs = []
    for size in (32, 16):  # largest first, as runners capture
        with torch.inference_mode(), BreakableCapture(backend) as capture:
            outs.append((capture, (x[:size] @ x).exp().sum(dim=0)))
    assert backend.pool.nbytes == 2 * 32 * 32 * 4
    x.mul_(0.5)
    for size, (capture, out) in zip((32, 16), outs, strict=True):
        capture.replay()
        assert torch.equal(out, (x[:size] @ x).exp().sum(dim=0))


def test_backend_misuse_is_one_clear_error() -> None:
    backend = TapeBackend()
    with pytest.raises(CaptureError, match="not recording"):
        backend.end_segment()
    backend.begin_segment()
    with pytest.raises(CaptureError, match="already recording"):
        backend.begin_segment()
    assert backend.end_segment() is None  # nothing was issued
