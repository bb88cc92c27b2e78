"""The capture protocol through the runners, on the faithful tape: what CUDA would do, on the CPU.

- V2 with the narrow region captures its prepare step and runs attention eagerly on what prepare
  computed: at capture, that is only true because each graph segment is replayed before the
  eager break after it. Without that replay, the eager attention indexes the KV cache with junk
  slot indices and the capture fails with an index error (on a GPU: a device-side assert).
- ``clear_graphs`` then recapture works, into a fresh pool; the old pool is retired.
- A capture that fails while a graph records (in the model or in the backend) leaves the runner
  usable: the next step captures again and is right; the next capture records into a fresh
  backend and pool, whatever failed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import runners.base
from graphs import BreakableCapture
from graphs.capture import _current as current_capture
from platforms import CpuPlatform, CudaPlatform, Platform
from runners import CUDAGraphMode, ModelRunner
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


def _fail_while_recording(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, where: str, skip: int = 0
) -> Callable[[], int]:
    """Make the runner's next capture after ``skip`` successful ones fail while a graph segment
    records (never in warm-up or an eager step): in the model (``where="model"``, an attention
    layer raising, as an illegal op does) or in the backend (``"backend"``, ending a segment
    raising, as a failed ``capture_end`` does). Returns how many failures were injected."""
    failures = {"n": 0}
    captures = {"n": 0}

    def armed() -> bool:
        capture = current_capture()
        return capture is not None and failures["n"] == 0 and captures["n"] > skip

    original_capture = runners.base.capture_step

    def counting_capture(*args: Any, **kwargs: Any) -> Any:
        captures["n"] += 1
        return original_capture(*args, **kwargs)

    monkeypatch.setattr(runners.base, "capture_step", counting_capture)
    if where == "model":
        layer = runner.model.attention_layers()[1]
        forward = layer.forward

        def raising(positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            if armed() and current_capture()._recording:  # type: ignore[union-attr]
                failures["n"] += 1
                raise RuntimeError("injected capture failure")
            return forward(positions, hidden)

        monkeypatch.setattr(layer, "forward", raising)
    else:
        backend_type = type(runner.graph_backend)
        end_segment = backend_type.end_segment

        def failing_end(self: Any) -> Any:
            if armed():
                failures["n"] += 1
                self.abort_segment()
                raise RuntimeError("injected capture failure")
            return end_segment(self)

        monkeypatch.setattr(backend_type, "end_segment", failing_end)
    return lambda: failures["n"]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("where", ["model", "backend"])
def test_a_failed_capture_leaves_the_runner_usable(
    platform: Platform, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_runner(resolve_on(platform, runner="v2", mode="FULL_AND_PIECEWISE"))
    reference = tiny_runner(resolve_on(platform, runner="v2", mode="NONE"))
    injected = _fail_while_recording(runner, monkeypatch, where)
    with pytest.raises(RuntimeError, match="injected capture failure"):
        greedy(runner, MIXED_BATCH, 3)
    assert injected() == 1 and runner.captured == ()
    got, expected = greedy(runner, MIXED_BATCH, 3), greedy(reference, MIXED_BATCH, 3)
    assert got.tokens == expected.tokens
    assert max_logit_difference(got, expected) <= TOLERANCE[platform.name]
    assert runner.captured


@pytest.mark.parametrize("where", ["model", "backend"])
def test_after_a_failed_capture_the_runner_records_into_a_fresh_backend_and_pool(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever failed, and although earlier graphs keep the old pool alive (not retired):
    a failed capture may leave its backend's stream and pool in any state (on CUDA an
    invalidated capture, blocks it allocated), so the next capture takes a fresh one."""
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"), max_graph_contexts=1)
    injected = _fail_while_recording(runner, monkeypatch, where, skip=2)
    old = runner.graph_backend
    with pytest.raises(RuntimeError, match="injected capture failure"):
        runner.capture()
    assert injected() == 1 and len(runner.captured) == 2
    assert not old.pool.graphs.retired  # the two graphs captured before still use it
    assert runner.graph_backend is not old and runner.graph_backend.pool is not old.pool
    runner.capture()
    assert len(runner.captured) == 6
