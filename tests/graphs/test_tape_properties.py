"""Properties of breakable capture on the tape, over randomly generated programs.

Positive: replaying a capture after overwriting its static inputs in place equals running the
program eagerly on the new inputs, bit for bit, over several consecutive replays.
Negative: a captured read of a freshly allocated index tensor is reported by the audit, and with
the audit off a replay after a new fresh tensor diverges from eager (the seed's bug in
miniature); a host read inside a captured segment raises ``CaptureError`` at its line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graphs import (
    AllocationTracker,
    BreakableCapture,
    CaptureError,
    StaticMemory,
    TapeBackend,
)
from graphs.backend import GraphBackend
from tests.graphs.random_programs import (
    GPU_OPS,
    Env,
    Program,
    S,
    T,
    Weights,
    count_breaks,
    programs,
    run,
)

REPLAYS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(_bits(actual), _bits(expected)), (actual - expected).abs().max()


def check_replay_equals_eager(
    program: Program,
    seed: int,
    keep_registers: bool,
    backend: GraphBackend,
    device: str,
    same: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weights = Weights(generator).to(device)
    env = Env.random(generator, device)
    static = StaticMemory()
    static.register_many((env.x, env.idx, env.cache), "input")
    static.register_module(weights)
    with torch.inference_mode():
        if device != "cpu":
            run(program, env.clone(), weights)  # warm up kernels and libraries outside capture
        with BreakableCapture(backend, static=static, audit="raise") as capture:
            outs = run(program, env, weights)
            if not keep_registers:
                outs = outs[-1:]
        assert capture.num_eager_breaks >= min(1, count_breaks(program))
        for _ in range(REPLAYS):
            new = Env.random(generator, device)
            env.overwrite_with(new)
            capture.replay()
            expected_env = new.clone()
            expected = run(program, expected_env, weights)[-len(outs) :]
            for actual, wanted in zip(outs, expected, strict=True):
                same(actual, wanted)
            same(env.cache, expected_env.cache)


@settings(max_examples=4 * settings.default.max_examples)  # examples are cheap
@given(program=programs(), seed=st.integers(0, 2**31 - 1), keep_registers=st.booleans())
def test_replay_equals_eager_on_new_static_inputs(
    program: Program, seed: int, keep_registers: bool
) -> None:
    """Holding every register alive or only the output exercises both kinds of tape memory:
    tensors the program still holds, and intermediates the tape re-homes into its arena."""
    check_replay_equals_eager(
        program, seed, keep_registers, TapeBackend(), "cpu", assert_bitwise_equal
    )


def _close_on_gpu(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Graph replay runs the captured kernels; a library may pick another kernel for the eager
    # reference (cuBLAS workspaces differ under capture), so bitwise is not promised on a GPU.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@settings(max_examples=10)
@given(program=programs(ops=GPU_OPS), seed=st.integers(0, 2**31 - 1))
def test_replay_equals_eager_on_new_static_inputs_on_the_gpu(program: Program, seed: int) -> None:
    from graphs.cuda_backend import CudaGraphBackend

    backend = CudaGraphBackend(device="cuda")
    check_replay_equals_eager(program, seed, False, backend, "cuda", _close_on_gpu)


def _fresh_positions(positions: list[int]) -> torch.Tensor:
    """Build an index tensor anew, as runner V1 builds attention metadata every step."""
    return torch.tensor(positions, dtype=torch.int64)


_FRESH_LINE = inspect.getsourcelines(_fresh_positions)[1] + 2

positions_st = st.permutations(range(S)).map(lambda p: list(p[:T]))


def _write_cache(x: torch.Tensor, index: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, index, x * 2.0 + 1.0)
    return cache.sum(dim=0)


@given(positions=positions_st)
def test_audit_reports_a_captured_read_of_a_fresh_index_tensor(positions: list[int]) -> None:
    x, cache = torch.randn(T, 8), torch.zeros(S, 8)
    static = StaticMemory()
    static.register(x, "x")
    static.register(cache, "cache")
    tracker = AllocationTracker()
    with tracker:
        index = _fresh_positions(positions)
    capture = BreakableCapture(static=static, audit="report", allocations=tracker)
    with torch.inference_mode(), capture:
        _write_cache(x, index, cache)
    (finding,) = capture.audit_report.findings
    assert finding.op == "aten.index_copy_.default"
    assert finding.shape == (T,)
    assert f"{__file__.rsplit('/', 1)[-1]}:{_FRESH_LINE}" in finding.allocated_at
    assert "_write_cache" in finding.location


@given(old=positions_st, new=positions_st)
def test_without_audit_a_new_fresh_index_tensor_makes_replay_diverge(
    old: list[int], new: list[int]
) -> None:
    assume(sorted(old) != sorted(new))
    generator = torch.Generator().manual_seed(sum(old) * 31 + sum(new))
    x, cache = torch.randn(T, 8, generator=generator), torch.zeros(S, 8)
    index = _fresh_positions(old)
    with torch.inference_mode():
        with BreakableCapture(audit="off") as capture:
            _write_cache(x, index, cache)
        cache.zero_()
        capture.replay()  # the runner built a new index tensor; the capture still reads the old
        expected_cache = torch.zeros(S, 8)
        _write_cache(x, _fresh_positions(new), expected_cache)
    assert not torch.equal(cache, expected_cache)
    assert torch.equal(cache[old], expected_cache[new])  # the same rows, at the stale positions


def _host_read(program: Program, env: Env, weights: Weights) -> float:
    return run(program, env, weights)[-1].sum().item()


_HOST_READ_LINE = inspect.getsourcelines(_host_read)[1] + 1


@given(program=programs(max_breaks=1), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10)
def test_a_host_read_in_a_captured_segment_raises_at_its_line(program: Program, seed: int) -> None:
    env = Env.random(torch.Generator().manual_seed(seed))
    weights = Weights(torch.Generator().manual_seed(seed))
    where = rf"test_tape_properties.py:{_HOST_READ_LINE} in _host_read"
    with (
        torch.inference_mode(),
        pytest.raises(CaptureError, match=rf"aten\.(item|_local_scalar_dense)\.default .*{where}"),
        BreakableCapture(),
    ):
        _host_read(program, env, weights)
