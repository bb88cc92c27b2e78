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


def test_views_of_memory_made_before_count_nothing() -> None:
    """A weight's transpose or a slice of a cache is no allocation of the step's (counting
    them put a 4-token eager step at 4.4 MB instead of its 58 KB)."""
    weight = torch.ones(256, 256)
    tracker = _PeakLiveBytes()
    with tracker:
        rows = weight[:128].t().unsqueeze(0)  # views only
        fresh = rows.sum()  # 4 bytes, new
    assert tracker.peak == fresh.untyped_storage().nbytes() == 4
    assert rows.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


def test_captures_hold_their_arena_and_what_each_segment_keeps() -> None:
    """What captures hold is the shared arena plus what each segment keeps of its own; the
    arena serves every graph and is no larger than the peak of the largest graph's eager step
    (the largest size, at the widest context bucket)."""
    runner = build_engine(EngineSpec(platform="cpu", capture_sizes=(1, 2, 4))).runner
    pool = runner.graph_backend.pool
    runner.capture()
    held = captures_held_bytes(runner)
    kept = sum(
        s.memory.retained_bytes + s.memory.constant_bytes
        for g in runner._graphs.values()
        for s in g.capture.segments
        if hasattr(s, "memory")
    )
    assert held is not None and pool.nbytes > 0 and held == pool.nbytes + kept
    eager = build_engine(EngineSpec(platform="cpu", cudagraph_mode="NONE")).runner
    widest = max(key.width for key in runner.captured)
    peak = eager_step_peak_bytes(eager, 4, widest)
    assert 0 < pool.nbytes <= peak
    assert eager_step_peak_bytes(eager, 1, widest) < peak  # the peak follows the step's size
