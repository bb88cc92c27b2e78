"""The capture protocol through the runners, on the faithful tape: what CUDA would do, on the CPU.

- V2 with the narrow region captures its prepare step and runs attention eagerly on what prepare
  computed: at capture, that is only true because each graph segment is replayed before the
  eager break after it. Without that replay, the eager attention indexes the KV cache with junk
  slot indices and the capture fails with an index error (on a GPU: a device-side assert).
- ``clear_graphs`` then recapture works, into a fresh pool; the old pool is retired.
- A capture that fails leaves the runner usable: the next step captures again and is right.
"""

from __future__ import annotations

import gc

import pytest
import torch

from graphs import BreakableCapture
from platforms import CpuPlatform, CudaPlatform, Platform
from runners import CUDAGraphMode
from tests.runners.support import (
    MIXED_BATCH,
    captured_sizes,
    greedy,
    max_logit_difference,
    resolve_on,
    tiny_runner,
)

PLATFORMS = [
    pytest.param(CpuPlatform(), id="cpu"),
    pytest.param(CudaPlatform(), id="cuda", marks=pytest.mark.cuda),
]
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-3}
"""Largest logit difference to eager: the tape is bitwise; GPU kernels differ by padded shape."""

SIZES = (1, 2, 4, 8)
"""Capture sizes covering every step of ``MIXED_BATCH`` under the test budget (7 tokens): mixed
steps are padded and replayed as piecewise graphs, not run eagerly above the largest size."""


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_v2_narrow_replays_mixed_steps_equal_to_eager(platform: Platform, mode: str) -> None:
    graphs = tiny_runner(resolve_on(platform, runner="v2", mode=mode), capture_sizes=SIZES)
    assert graphs.eager_region.name == "narrow"
    reference = tiny_runner(resolve_on(platform, runner="v2", mode="NONE"), capture_sizes=SIZES)
    got, expected = greedy(graphs, MIXED_BATCH, 6), greedy(reference, MIXED_BATCH, 6)
    assert got.tokens == expected.tokens
    assert max_logit_difference(got, expected) <= TOLERANCE[platform.name]
    assert graphs.audit_findings == ()
    assert (CUDAGraphMode.PIECEWISE, 8) in captured_sizes(graphs)  # mixed steps replayed piecewise


def test_without_the_replay_before_each_break_v2_narrow_fails_to_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BreakableCapture, "_replay_recorded", lambda self, segment: None)
    runner = tiny_runner(resolve_on(runner="v2", mode="PIECEWISE"), capture_sizes=SIZES)
    with pytest.raises(IndexError, match="index out of range"):
        greedy(runner, MIXED_BATCH, 2)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_clear_graphs_then_recapture_into_a_fresh_pool(platform: Platform) -> None:
    runner = tiny_runner(resolve_on(platform, runner="v2", mode="FULL_AND_PIECEWISE"))
    first = greedy(runner, MIXED_BATCH, 4)
    old_pool = runner.graph_backend.pool
    gc.disable()  # the old graphs must go by reference count alone (no reference cycle)
    try:
        runner.clear_graphs()
        assert old_pool.graphs.retired
    finally:
        gc.enable()
    second = greedy(runner, MIXED_BATCH, 4)
    assert runner.graph_backend.pool is not old_pool
    assert second.tokens == first.tokens
    assert max_logit_difference(second, first) <= TOLERANCE[platform.name]


def test_two_runners_on_one_platform_never_share_a_pool() -> None:
    resolution = resolve_on(runner="v2", mode="FULL_AND_PIECEWISE")
    a, b = tiny_runner(resolution), tiny_runner(resolution)
    assert a.graph_backend.pool is not b.graph_backend.pool


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_failed_capture_leaves_the_runner_usable(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_runner(resolve_on(platform, runner="v2", mode="FULL_AND_PIECEWISE"))
    reference = tiny_runner(resolve_on(platform, runner="v2", mode="NONE"))
    layer = runner.model.attention_layers()[1]
    original = layer.forward
    calls = {"n": 0}

    def fails_once(positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected capture failure")
        return original(positions, hidden)

    monkeypatch.setattr(layer, "forward", fails_once)
    with pytest.raises(RuntimeError, match="injected capture failure"):
        greedy(runner, MIXED_BATCH, 3)
    assert runner.captured == ()
    got, expected = greedy(runner, MIXED_BATCH, 3), greedy(reference, MIXED_BATCH, 3)
    assert got.tokens == expected.tokens
    assert max_logit_difference(got, expected) <= TOLERANCE[platform.name]
