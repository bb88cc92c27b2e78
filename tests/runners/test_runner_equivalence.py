"""Every valid (runner, graph mode) pair generates the same greedy tokens as eager, on the CPU.

The reference is the eager step of the runner machinery (mode NONE, nothing captured), itself
checked against the model's own uncached-by-runner harness in ``test_eager_reference``. Batches
mix requests with different prompt lengths; prefill is chunked under a small token budget, so
steps are mixed batches padded to a captured size, mixed batches above the largest size (run
eagerly), and uniform-decode batches — captured once and replayed on every later step and
example.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4.testing import run_schedule
from platforms import CudaPlatform, Platform, RocmPlatform, simulate
from runners import CUDAGraphMode, ModelRunner
from runners.measure.equivalence import equality_tolerance
from tests.runners.support import (
    MIXED_BATCH,
    Generation,
    fresh_model,
    greedy,
    max_logit_difference,
    prompts,
    resolve_on,
    tiny_runner,
)

PAIRS = [(runner, mode) for runner in ("v1", "v2") for mode in CUDAGraphMode]
_runners: dict[tuple[object, ...], ModelRunner] = {}


def runner_for(runner: str, mode: CUDAGraphMode) -> ModelRunner:
    """One runner per distinct resolution, kept for the whole module (captures are reused)."""
    r = resolve_on(runner=runner, mode=mode)
    key = (r.runner, r.decode_mode, r.mixed_mode, r.eager_region)
    if key not in _runners:
        _runners[key] = tiny_runner(r)
    return _runners[key]


def eager(batch: list[list[int]], max_tokens: int) -> Generation:
    return greedy(runner_for("v2", CUDAGraphMode.NONE), batch, max_tokens)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_request_crossing_context_buckets_mid_generation_equals_eager(runner: str) -> None:
    """A 6-token prompt generating 20 tokens crosses the 8- and 16-token bucket boundaries
    while decoding: its decode steps replay graphs of three context widths (FULL for V2,
    PIECEWISE for V1)."""
    under_test = runner_for(runner, CUDAGraphMode.FULL_AND_PIECEWISE)
    batch = [[5, 9, 200, 31, 7, 64]]
    got, reference = greedy(under_test, batch, 20), eager(batch, 20)
    assert got.tokens == reference.tokens
    assert max_logit_difference(got, reference) <= 1e-5
    widths = {key.width for key in under_test.captured if key.mode is under_test.decode_mode}
    assert widths == set(under_test.context_buckets.widths) == {2, 4, 8}


@pytest.mark.parametrize(("runner", "mode"), PAIRS, ids=[f"{r}-{m.name}" for r, m in PAIRS])
@settings(max_examples=4)
@given(batch=prompts, max_tokens=st.integers(2, 6))
@example(batch=MIXED_BATCH, max_tokens=6)
def test_pair_generates_the_eager_tokens(
    runner: str, mode: CUDAGraphMode, batch: list[list[int]], max_tokens: int
) -> None:
    under_test = runner_for(runner, mode)
    reference = eager(batch, max_tokens)
    got = greedy(under_test, batch, max_tokens)
    assert got.tokens == reference.tokens
    assert max_logit_difference(got, reference) <= 1e-5
    captured_modes = {key.mode for key in under_test.captured}
    expected_modes = {under_test.decode_mode, under_test.mixed_mode} - {CUDAGraphMode.NONE}
    assert captured_modes <= expected_modes


def test_the_pairs_cover_every_resolved_configuration() -> None:
    """V1 never gets FULL graphs; V2 gets FULL decode graphs; both capture piecewise."""
    seen = {
        (r.runner.name, r.decode_mode, r.mixed_mode, r.eager_region.name)
        for r in (resolve_on(runner=runner, mode=mode) for runner, mode in PAIRS)
    }
    full, piecewise, none = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
    assert seen == {
        ("v1", none, none, "no-graph"),
        ("v1", piecewise, piecewise, "wide"),
        ("v1", piecewise, none, "wide"),
        ("v2", none, none, "no-graph"),
        ("v2", piecewise, piecewise, "narrow"),
        ("v2", full, piecewise, "narrow"),
        ("v2", full, none, "full-graph"),
    }


@settings(max_examples=3)
@given(batch=prompts, max_tokens=st.integers(1, 4))
def test_eager_reference(batch: list[list[int]], max_tokens: int) -> None:
    """The eager runner's greedy tokens are the argmax of the model's teacher-forced logits."""
    generated = eager(batch, max_tokens)
    sequences = [p + list(out[:-1]) for p, out in zip(batch, generated.tokens, strict=True)]
    logits = run_schedule(
        fresh_model(), sequences, [[(i, len(s)) for i, s in enumerate(sequences)]]
    )
    for prompt, out, rows in zip(batch, generated.tokens, logits, strict=True):
        assert tuple(rows[len(prompt) - 1 :].argmax(-1).tolist()) == out


@pytest.mark.parametrize(
    "platform", [CudaPlatform(), RocmPlatform()], ids=["simulated-cuda", "simulated-rocm"]
)
def test_simulated_platforms_run_their_policy_on_the_cpu(platform: Platform) -> None:
    resolution = resolve_on(simulate(platform))
    expected_runner = "v1" if platform.name == "rocm" else "v2"
    assert resolution.runner.name == expected_runner
    runner = tiny_runner(resolution, capture_sizes=(4,))
    assert runner.device.type == "cpu" and runner.platform.simulated
    assert greedy(runner, MIXED_BATCH, 6).tokens == eager(MIXED_BATCH, 6).tokens
    assert runner.captured


@pytest.mark.cuda
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_real_cuda_graphs_generate_the_eager_tokens(runner: str) -> None:
    """On a GPU: the resolved runner with CUDA graphs vs the same runner machinery eagerly."""
    cuda = CudaPlatform() if torch.version.hip is None else RocmPlatform()
    graphs = tiny_runner(resolve_on(cuda, runner=runner))
    reference = tiny_runner(resolve_on(cuda, runner=runner, mode=CUDAGraphMode.NONE))
    got = greedy(graphs, MIXED_BATCH, 6)
    expected = greedy(reference, MIXED_BATCH, 6)
    assert got.tokens == expected.tokens
    assert max_logit_difference(got, expected) <= equality_tolerance("cuda", torch.float32)
    assert graphs.captured and graphs.audit_findings == ()
