"""``runners.measure.floor``: the machine figures, the step's bytes and ops, and the multiples
``dsv4 bench`` reports against them."""

from __future__ import annotations

import torch

from dsv4.traffic import StepReads
from graphs.op_count import OpCounter
from runners.measure.benchmark import DecodeLatency, decode_runners
from runners.measure.floor import (
    Machine,
    StepShape,
    empty_op_seconds,
    floor_rows,
    multiply_add_rate,
    read_bandwidth,
    step_shapes,
)
from runners.spec import EngineSpec, build_model


def test_floor_rows_divide_each_median_by_the_largest_floor() -> None:
    """2 MB at 1 GB/s is a 2 000 us memory floor; 1.25 M multiply-adds at 1 GFLOP/s a 2 500 us
    compute floor; 3 000 ops at 1 us a 3 000 us dispatch floor (the largest for eager), 1 000
    ops a 1 000 us one (for FULL the compute floor is the largest)."""
    reads = StepReads(
        weights=1_500_000,
        experts=400_000,
        rows=60_000,
        kv=40_000,
        distinct_experts=(1,),
        multiply_adds=1_250_000,
    )
    shape = StepShape(batch_size=4, reads=reads, ops={"eager": 3000, "full": 1000})
    machine = Machine(threads=1, read_bytes_per_s=1e9, empty_op_s=1e-6, flops_per_s=1e9)
    latency = DecodeLatency(threads=1, batch_size=4, median_us={"eager": 6000.0, "full": 3000.0})
    [row] = floor_rows([latency], [machine], [shape])
    assert row["memory_floor_us"] == 2000.0
    assert row["compute_floor_us"] == 2500.0
    assert row["dispatch_floor_us"] == {"eager": 3000.0, "full": 1000.0}
    assert row["x_floor"] == {"eager": 2.0, "full": 1.2}
    assert row["x_memory_floor"] == {"eager": 3.0, "full": 1.5}


def test_machine_figures_are_measured() -> None:
    device = torch.device("cpu")
    assert read_bandwidth(device, nbytes=1 << 20, samples=3) > 1e8
    assert 0 < empty_op_seconds(device, calls=200, samples=3) < 1e-3
    assert multiply_add_rate(device, size=128, samples=3) > 1e8


def test_op_counter_counts_composites_as_the_ops_they_run() -> None:
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    counter = OpCounter()
    with counter:
        torch.nn.functional.linear(x, w)  # a transpose (a view) and a product on a CPU
        x.add_(1)
    assert dict(counter.by_name) == {"t": 1, "mm": 1, "add_": 1}
    assert counter.total == 3


def test_step_shapes_count_each_configuration_and_the_eager_routing() -> None:
    spec = EngineSpec(capture_sizes=(1, 2))
    runners = decode_runners(spec, lambda: build_model(spec), ("eager", "full"))
    [shape] = step_shapes(runners, "eager", [2])
    assert shape.batch_size == 2
    assert shape.reads.distinct_experts[0] >= 1 and len(shape.reads.distinct_experts) == 3
    assert shape.reads.kv > 0 and shape.reads.total > shape.reads.weights
    # two tokens multiply every float32 weight element they read whole (4 bytes each), and
    # their expert slots more
    assert shape.reads.multiply_adds > 2 * shape.reads.weights // 4
    # a FULL replay issues what its tape replays: no views, no Python-built module calls
    assert 0 < shape.ops["full"] < shape.ops["eager"]
