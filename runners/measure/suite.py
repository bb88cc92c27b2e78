"""The benchmark suite behind ``dsv4 bench``: capture cost, decode latency, throughput.

``run_benchmark`` measures one platform (``base.platform``, simulated or not) and returns the
payload the CLI prints: the capture cost of every default size against an eager step, what each
timed configuration resolved to (with the reasons of any downgrade; configurations the platform
refuses are skipped), decode-step latency per configuration, thread count and batch size
(interleaved, medians, ratios from the same run), and generation throughput (and
transformers', when asked). Every interval waits for the device to finish the work it times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from dsv4.dtypes import dtype_name
from dsv4.parallel import COLLECTIVES
from runners.errors import ResolutionError
from runners.measure import floor
from runners.measure.benchmark import (
    GenerationThroughput,
    capture_cost,
    decode_latency,
    decode_runners,
    decode_specs,
    eager_step_peak_bytes,
    engine_throughput,
    torch_threads,
)
from runners.measure.hf_baseline import transformers_baseline
from runners.spec import EngineSpec, build_engine, build_model, compute_dtype_of, resolve_spec

__all__ = ["BenchOptions", "run_benchmark"]


@attrs.frozen(kw_only=True)
class BenchOptions:
    """What to measure besides the platform and model (``EngineSpec``)."""

    batch_sizes: tuple[int, ...]
    threads: tuple[int, ...]
    repeats: int
    generate_prompts: int
    max_new_tokens: int
    rounds: int
    vs_transformers: bool


def run_benchmark(
    base: EngineSpec, options: BenchOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Measure ``base``'s platform and model; ``progress`` gets a line before each phase."""
    spec = attrs.evolve(base, capture_sizes=tuple(sorted(set(options.batch_sizes) | {16})))
    progress("capturing every default size")
    payload: dict[str, Any] = {
        "checkpoint": None if base.checkpoint is None else str(base.checkpoint),
        "dtype": dtype_name(compute_dtype_of(base)),
    }
    payload.update(_capture(base))
    payload["method"] = _METHOD
    progress("timing decode steps")
    payload["configurations"] = _configurations(spec)
    runnable = [n for n, c in payload["configurations"].items() if "refused" not in c]
    payload["decode"], payload["limit"], share = _decode(spec, options, runnable)
    payload["tensor_parallel_size"] = base.tensor_parallel_size
    payload["collective_share_of_decode"] = round(share, 3)
    progress("timing generation")
    payload["generation"] = _generation(base, spec, options)
    return payload


def _capture(base: EngineSpec) -> dict[str, Any]:
    """The platform measured, and the capture cost of every default size and bucket (the set
    ``dsv4 serve`` captures, its requests unknown) against an eager step."""
    torch.set_num_threads(1)
    engine = build_engine(base)
    runner = engine.runner
    cost = capture_cost(runner)
    eager_runner = build_engine(attrs.evolve(base, cudagraph_mode="NONE")).runner
    widest = max(key.width for key in runner.captured)
    peak = eager_step_peak_bytes(eager_runner, max(runner.capture_sizes.sizes), widest)
    platform = engine.resolution.platform
    return {
        "platform": platform.name,
        "simulated": platform.simulated,
        "device": platform.device_type,
        "capture": {
            "seconds_per_graph": [list(t) for t in cost.seconds_per_graph],
            "total_s": round(cost.total_seconds, 4),
            "held_bytes": cost.held_bytes,
            "eager_step_peak_bytes": peak,
            "held/eager_step_peak": None
            if cost.held_bytes is None
            else round(cost.held_bytes / peak, 3),
        },
    }


_RATIOS = (("full", "eager"), ("narrow", "eager"), ("wide", "eager"), ("narrow", "wide"))


def _configurations(spec: EngineSpec) -> dict[str, dict[str, Any]]:
    """What each timed configuration resolved to on the platform measured, with the reasons of
    any downgrade (a column named ``full`` may run PIECEWISE decode graphs where the platform
    or runner forbids FULL ones)."""
    configurations: dict[str, dict[str, Any]] = {}
    for name, config in decode_specs(spec).items():
        try:
            resolution = resolve_spec(config)
        except ResolutionError as exc:
            configurations[name] = {"refused": str(exc)}
            continue
        configurations[name] = {
            "runner": resolution.runner.name,
            "decode": resolution.decode_mode.name,
            "mixed": resolution.mixed_mode.name,
            "eager_region": resolution.eager_region.name,
            "downgrades": [r for r in resolution.reasons if "downgraded" in r],
        }
    return configurations


def _decode(
    spec: EngineSpec, options: BenchOptions, names: list[str]
) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    """Median decode-step latency per configuration in ``names`` (those the platform does not
    refuse), thread count and batch size (a ratio with a refused side is ``None``); the floor
    under each step (``runners.measure.floor``); and the share of the decode timing's wall time
    this rank spent in collectives (0 on one rank)."""
    runners = decode_runners(spec, lambda: build_model(spec), names)
    device = next(iter(runners.values())).device
    machines = floor.machine(device, options.threads)
    COLLECTIVES.reset()
    start = time.perf_counter()
    latencies = decode_latency(
        runners, batch_sizes=options.batch_sizes, threads=options.threads, repeats=options.repeats
    )
    share = COLLECTIVES.seconds / (time.perf_counter() - start)
    with torch_threads(min(options.threads)):
        shapes = floor.step_shapes(runners, "eager", options.batch_sizes)
    rows = [
        {
            "threads": row.threads,
            "batch_size": row.batch_size,
            "median_us": {k: round(v, 1) for k, v in row.median_us.items()},
            "ratios": {
                f"{a}/{b}": None if a not in names or b not in names else round(row.ratio(a, b), 3)
                for a, b in _RATIOS
            },
        }
        for row in latencies
    ]
    limit = {
        "machine": [
            {
                "threads": m.threads,
                "read_bandwidth_gb_s": round(m.read_bytes_per_s / 1e9, 2),
                "empty_op_us": round(m.empty_op_s * 1e6, 3),
                "gflops": round(m.flops_per_s / 1e9, 2),
            }
            for m in machines
        ],
        "steps": [
            {"batch_size": s.batch_size, "bytes": s.reads.to_dict(), "ops": s.ops} for s in shapes
        ],
        "rows": floor.floor_rows(latencies, machines, shapes),
        "method": floor.METHOD,
    }
    return rows, limit, share


def _generation(base: EngineSpec, spec: EngineSpec, options: BenchOptions) -> dict[str, Any]:
    """Generation tokens per second (median of rounds), and transformers' when asked."""
    torch.set_num_threads(1)
    prompts = [
        [(11 * p + 3 * i) % 256 for i in range(8 + 4 * p)] for p in range(options.generate_prompts)
    ]
    model = build_model(spec)
    ours, our_tokens, run_capture = engine_throughput(base, model, prompts, options.max_new_tokens)
    device = next(model.parameters()).device  # where the engine put it
    contenders: dict[str, Callable[[], GenerationThroughput]] = {"engine": ours}
    if options.vs_transformers:
        baseline = transformers_baseline(
            base.checkpoint,
            prompts,
            options.max_new_tokens,
            dtype=compute_dtype_of(base),
            device=device,
        )
        contenders["transformers"] = baseline.round
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(options.rounds):  # alternating: each round times every contender once
        for name, contender in contenders.items():
            rounds[name].append(contender().tokens_per_s)
    generation: dict[str, Any] = {
        "prompts": len(prompts),
        "max_new_tokens": options.max_new_tokens,
        "run_capture": {
            "graphs": len(run_capture.seconds_per_graph),
            "total_s": round(run_capture.total_seconds, 4),
        },
        "tokens_per_s": {k: round(statistics.median(v), 2) for k, v in rounds.items()},
    }
    if options.vs_transformers:
        tps = generation["tokens_per_s"]
        generation["ratio_engine/transformers"] = round(tps["engine"] / tps["transformers"], 3)
        generation["devices"] = {"engine": device.type, "transformers": baseline.device.type}
        generation["same_tokens_as_generate"] = our_tokens == baseline.generate_tokens
        generation["same_tokens_as_uncached_forward"] = our_tokens == baseline.uncached_tokens
    return generation


_METHOD = (
    "decode: one runner per configuration over identical weights, the same requests prefilled "
    "in each, single decode steps timed interleaved (rotating order), each from a drained device "
    "until the device finished it (CUDA events on a GPU), medians; generation: greedy, graphs "
    "captured beforehand, alternating rounds, medians; one thread unless stated"
)
