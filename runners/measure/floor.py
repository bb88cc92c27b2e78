"""The floor under a decode step, measured in the benchmark's own run (``dsv4 bench``'s ``limit``).

A step can be no faster than the largest of three floors (DESIGN §12):
- **memory floor** = bytes the step must read (``dsv4.traffic.decode_reads``: the weights its
  tokens touch given the routing it actually took, plus the KV it attends) / the streaming read
  bandwidth measured here: the seconds to sum a float32 tensor of ``READ_BYTES`` (far larger than
  any CPU's last-level cache), median of ``SAMPLES``;
- **compute floor** = 2 x the multiply-adds of the step's weight products
  (``StepReads.multiply_adds``) / the float32 multiply-add rate measured here: a
  ``GEMM_SIZE``-square matrix product (the rate a well-blocked product reaches), median of
  ``GEMM_SAMPLES``;
- **dispatch floor** = the ops one step issues (``graphs.op_count.OpCounter`` around one
  ``execute`` of the configuration: the runner's host-side ops too) x the cost of an empty op:
  ``torch.add`` of one-element tensors into one of them, from Python, in inference mode as
  steps run, ``EMPTY_OP_CALLS`` calls timed together, median of ``SAMPLES``.
Both machine figures are measured per thread count, in the same process as the timed steps,
each interval until the device finished it (``timed``). A configuration's step is then reported
as a multiple of the largest floor and of the memory floor alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from dsv4.traffic import StepReads, decode_reads, recorded_routes
from graphs.op_count import OpCounter
from runners.base import ModelRunner
from runners.measure.benchmark import (
    DECODE_PROMPT_LEN,
    DecodeLatency,
    decode_token_ids,
    prefill_requests,
    timed,
    torch_threads,
)

__all__ = [
    "EMPTY_OP_CALLS",
    "GEMM_SAMPLES",
    "GEMM_SIZE",
    "METHOD",
    "READ_BYTES",
    "SAMPLES",
    "Machine",
    "StepShape",
    "empty_op_seconds",
    "floor_rows",
    "machine",
    "multiply_add_rate",
    "read_bandwidth",
    "step_shapes",
]

METHOD = (
    "memory floor = bytes the step must read (weights its tokens touch given the routing taken, "
    "distinct experts once, plus the KV it attends) / streaming read bandwidth (a sum over a "
    "256 MiB float32 tensor, median of 15); dispatch floor = ATen ops one step issues (counted "
    "around one execute) x the cost of an empty op (a one-element add from Python, median); "
    "compute floor = 2 x the multiply-adds of the step's weight products / the float32 rate of "
    "a 1024-square matrix product (median of 5); x_floor = median step / the largest of the "
    "three floors; measured per thread count in the same run"
)

READ_BYTES = 256 << 20
SAMPLES = 15
EMPTY_OP_CALLS = 2000
GEMM_SIZE = 1024
GEMM_SAMPLES = 5


@attrs.frozen(kw_only=True)
class Machine:
    """What the device does at one thread count: streaming reads and empty ops."""

    threads: int
    read_bytes_per_s: float
    empty_op_s: float
    flops_per_s: float


@attrs.frozen(kw_only=True)
class StepShape:
    """One decode step of ``batch_size`` requests: the bytes it must read and the ops each
    configuration issues for it."""

    batch_size: int
    reads: StepReads
    ops: dict[str, int]


def read_bandwidth(device: torch.device, nbytes: int = READ_BYTES, samples: int = SAMPLES) -> float:
    """Bytes per second one ``sum`` streams from a float32 tensor of ``nbytes`` (median)."""
    data = torch.ones(nbytes // 4, device=device)
    data.sum()  # touched once, so no sample pays for first-use page faults
    seconds = [timed(data.sum, device)[1] for _ in range(samples)]
    return nbytes / statistics.median(seconds)


def empty_op_seconds(
    device: torch.device, calls: int = EMPTY_OP_CALLS, samples: int = SAMPLES
) -> float:
    """Seconds per call of an op that does (almost) nothing: ``torch.add`` of one-element
    tensors into one of them, called from Python in inference mode (median)."""
    with torch.inference_mode():
        one = torch.zeros(1, device=device)

        def ops() -> None:
            for _ in range(calls):
                torch.add(one, one, out=one)

        ops()
        seconds = [timed(ops, device)[1] for _ in range(samples)]
    return statistics.median(seconds) / calls


def multiply_add_rate(
    device: torch.device, size: int = GEMM_SIZE, samples: int = GEMM_SAMPLES
) -> float:
    """Floating-point operations per second (a multiply-add counts two) of a float32
    ``size``-square matrix product (median)."""
    a = torch.rand(size, size, device=device)
    out = torch.empty(size, size, device=device)

    def product() -> None:
        torch.mm(a, a, out=out)

    product()
    seconds = [timed(product, device)[1] for _ in range(samples)]
    return 2 * size**3 / statistics.median(seconds)


def machine(device: torch.device, threads: Sequence[int]) -> list[Machine]:
    """Both machine figures at each thread count."""
    found = []
    for count in threads:
        with torch_threads(count):
            found.append(
                Machine(
                    threads=count,
                    read_bytes_per_s=read_bandwidth(device),
                    empty_op_s=empty_op_seconds(device),
                    flops_per_s=multiply_add_rate(device),
                )
            )
    return found


def step_shapes(
    runners: dict[str, ModelRunner], reference: str, batch_sizes: Sequence[int]
) -> list[StepShape]:
    """For each batch size, the decode step ``decode_latency`` times: the same requests
    prefilled in every runner, then one step each (graphs captured, caches warm) and one step
    counted; the bytes follow the routing ``reference``'s runner (whose model runs eagerly,
    so its routers are called) takes in its counted step."""
    shapes = []
    for batch in batch_sizes:
        ids = decode_token_ids(batch)
        ops: dict[str, int] = {}
        reads: StepReads | None = None
        for name, runner in runners.items():
            chunks = prefill_requests(runner, batch, DECODE_PROMPT_LEN)
            runner.execute(chunks, ids)
            counter = OpCounter()
            with recorded_routes(runner.model) as routes, counter:
                runner.execute(chunks, ids)
            ops[name] = counter.total
            if name == reference:
                positions = [chunk.start_position for chunk in chunks]
                reads = decode_reads(runner.model, [t[0] for t in ids], positions, routes)
        if reads is None:
            raise ValueError(f"no runner named {reference!r} to take the routing from")
        shapes.append(StepShape(batch_size=batch, reads=reads, ops=ops))
    return shapes


def floor_rows(
    latencies: Sequence[DecodeLatency], machines: Sequence[Machine], shapes: Sequence[StepShape]
) -> list[dict[str, Any]]:
    """One row per timed (threads, batch): the floors and each configuration's multiple."""
    by_threads = {m.threads: m for m in machines}
    by_batch = {s.batch_size: s for s in shapes}
    rows = []
    for latency in latencies:
        host, shape = by_threads[latency.threads], by_batch[latency.batch_size]
        memory_us = shape.reads.total / host.read_bytes_per_s * 1e6
        compute_us = 2 * shape.reads.multiply_adds / host.flops_per_s * 1e6
        dispatch_us = {n: ops * host.empty_op_s * 1e6 for n, ops in shape.ops.items()}
        rows.append(
            {
                "threads": latency.threads,
                "batch_size": latency.batch_size,
                "memory_floor_us": round(memory_us, 3),
                "compute_floor_us": round(compute_us, 3),
                "dispatch_floor_us": {n: round(us, 3) for n, us in dispatch_us.items()},
                "x_floor": {
                    n: round(us / max(memory_us, compute_us, dispatch_us[n]), 2)
                    for n, us in latency.median_us.items()
                },
                "x_memory_floor": {
                    n: round(us / memory_us, 2) for n, us in latency.median_us.items()
                },
            }
        )
    return rows
