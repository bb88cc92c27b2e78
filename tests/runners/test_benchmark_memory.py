"""The memory figures of ``dsv4 bench``: an eager step's peak live bytes and what captures hold
(on the ``cpu`` platform, whose tape pool reports its size; CUDA's reports none)."""

from __future__ import annotations

import torch

from runners.measure.benchmark import _PeakLiveBytes, captures_held_bytes, eager_step_peak_bytes
from runners.spec import EngineSpec, build_engine


def test_peak_counts_storages_alive_together_and_forgets_freed_ones() -> None:
    x = torch.ones(8)
    tracker = _PeakLiveBytes()
    with tracker:
        a = x.repeat(128)  # 4 KiB
        b = x.repeat(256)  # 8 KiB, with `a` alive: 12 KiB
        view = b[:10]  # a view allocates nothing
        del a, b, view
        c = x.repeat(512)  # 16 KiB alone
        del c
        d = x.repeat(64)  # 2 KiB
    assert tracker.peak == 16 << 10
    assert d.numel() == 512


def test_captures_hold_their_arena_and_less_than_twice_an_eager_step() -> None:
    runner = build_engine(EngineSpec(platform="cpu", capture_sizes=(1, 2, 4))).runner
    pool = runner.graph_backend.pool
    runner.capture()
    held = captures_held_bytes(runner)
    assert held is not None and held > pool.nbytes > 0
    eager = build_engine(EngineSpec(platform="cpu", cudagraph_mode="NONE")).runner
    peak = eager_step_peak_bytes(eager, 4)
    assert peak > 0 and held <= 2 * peak
