"""Measure decode latency, capture cost and generation throughput, as ratios of medians.

Decode-step latency of eager vs FULL vs PIECEWISE narrow and wide; capture time per size and
memory held by captures; tokens per second of the engine (and of transformers' generate).
Configurations are timed interleaved in one run and reported as medians and their ratios.

Every interval waits for the device to finish the work it times (CUDA events on a GPU), and the
output names the platform measured: --platform and --simulate choose it as for 'dsv4 run'.

Examples:
  dsv4 bench                                  # built-in tiny model, batch 1,4,16, 1 and 2 threads
  dsv4 bench --vs-transformers --json         # also transformers' generate on the same weights
  dsv4 bench --checkpoint ./ckpt --batch-sizes 1 --threads 1
  dsv4 bench --platform rocm --simulate       # ROCm's policy, run on the CPU tape
  dsv4 bench --checkpoint ./small --dtype bfloat16 --prefix-cache-ttft --threads 1
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from runners.cli.context_sweep import add_sweep_arguments, render_sweep, sweep_options
from runners.cli.errors import UsageError
from runners.cli.options import (
    PLATFORM_HELP,
    SIMULATE_HELP,
    add_capacity_options,
    add_dtype_option,
    add_parallel_option,
    add_quantization_option,
    capacity_fields,
    parse_positive_int_list,
)
from runners.cli.prefix_ttft import add_prefix_arguments, prefix_options, render_prefix
from runners.cli.progress import Progress
from runners.cli.values import at_least
from runners.measure.context_sweep import run_context_sweep
from runners.measure.prefix_ttft import run_prefix_ttft
from runners.measure.suite import BenchOptions, run_benchmark
from runners.spec import EngineSpec

__all__ = ["add_arguments", "execute", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="default: the built-in tiny model")
    add_dtype_option(parser)
    add_quantization_option(parser)
    parser.add_argument("--platform", help=PLATFORM_HELP)
    parser.add_argument("--simulate", action="store_true", help=SIMULATE_HELP)
    parser.add_argument(
        "--batch-sizes",
        type=parse_positive_int_list,
        default=[1, 4, 16],
        metavar="N,N,...",
        help="decode batch sizes (default: 1,4,16)",
    )
    parser.add_argument(
        "--threads",
        type=parse_positive_int_list,
        default=None,
        metavar="N,N,...",
        help="torch thread counts (default: 1,2; with --prefix-cache-ttft one count, by "
        "default the model's: 1 up to hidden size 512)",
    )
    parser.add_argument(
        "--repeats",
        type=at_least(1),
        default=None,
        help="timed rounds (default: 50; with --prefix-cache-ttft, requests per engine: 10)",
    )
    parser.add_argument(
        "--vs-transformers",
        action="store_true",
        help="also time transformers' generate on the same weights (needs transformers)",
    )
    parser.add_argument(
        "--generate-prompts", type=at_least(1), default=4, help="prompts for the throughput run (4)"
    )
    parser.add_argument("--max-new-tokens", type=at_least(1), default=32, help="default: 32")
    parser.add_argument(
        "--rounds", type=at_least(1), default=3, help="throughput rounds (default: 3)"
    )
    add_capacity_options(parser)
    add_parallel_option(parser)
    add_sweep_arguments(parser)
    add_prefix_arguments(parser)


def _validate(args: argparse.Namespace) -> None:
    if max(args.batch_sizes) > args.max_num_seqs:
        raise UsageError(
            f"--batch-sizes are at most --max-num-seqs ({args.max_num_seqs}), the requests "
            "in flight at once"
        )


def execute(args: argparse.Namespace) -> dict[str, Any]:
    _validate(args)
    progress = Progress.for_terminal(json_output=args.json)
    if args.prefix_cache_ttft:  # one thread count (the model's default without --threads)
        base = EngineSpec(
            checkpoint=Path(args.checkpoint) if args.checkpoint else None,
            quantization=args.quantization,
            dtype=args.dtype,
            platform=args.platform,
            simulate=args.simulate,
            **capacity_fields(args),
        )
        measured = run_prefix_ttft(base, prefix_options(args), progress.update)
        progress.done("prefix-cache time to first token done")
        return {"prefix_cache_ttft": measured}
    args.threads = args.threads or [1, 2]
    args.repeats = args.repeats or 50
    if args.context_sweep:
        base = EngineSpec(
            checkpoint=Path(args.checkpoint) if args.checkpoint else None,
            quantization=args.quantization,
            dtype=args.dtype,
            platform=args.platform,
            simulate=args.simulate,
        )
        sweep = run_context_sweep(base, sweep_options(args), progress.update)
        progress.done("context sweep done")
        return {"context_sweep": sweep}
    base = EngineSpec(
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        quantization=args.quantization,
        dtype=args.dtype,
        platform=args.platform,
        simulate=args.simulate,
        **capacity_fields(args),
    )
    options = BenchOptions(
        batch_sizes=tuple(args.batch_sizes),
        threads=tuple(args.threads),
        repeats=args.repeats,
        generate_prompts=args.generate_prompts,
        max_new_tokens=args.max_new_tokens,
        rounds=args.rounds,
        vs_transformers=args.vs_transformers,
    )
    payload = run_benchmark(base, options, progress.update)
    progress.done("benchmark done")
    return payload


def _cell(value: float | None, width: int, spec: str) -> str:
    """A right-aligned table cell; ``-`` for a configuration the platform refused."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def _mib(nbytes: int | None) -> str:
    """``nbytes`` in MiB, or ``n/a`` where the pool reports no size (``None``, as on CUDA)."""
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def _render_limit(limit: dict[str, Any]) -> list[str]:
    """The floor under each step, and each configuration's step as a multiple of it."""
    lines = [
        "the floor (memory: bytes a step must read / read bandwidth; compute: its weight "
        "products / a large product's rate; dispatch: ops x an empty op):"
    ]
    lines += [
        f"  {m['threads']} thread(s): read {m['read_bandwidth_gb_s']:.1f} GB/s, "
        f"{m['gflops']:.1f} GFLOP/s, empty op {m['empty_op_us']:.2f} us"
        for m in limit["machine"]
    ]
    steps = {s["batch_size"]: s for s in limit["steps"]}
    for row in limit["rows"]:
        step = steps[row["batch_size"]]
        read = step["bytes"]
        lines.append(
            f"  threads {row['threads']}, batch {row['batch_size']}: {read['total'] / 1e6:.2f} MB "
            f"({read['experts'] / 1e6:.2f} MB of {sum(read['distinct_experts'])} routed experts, "
            f"{read['kv'] / 1e3:.1f} kB of KV), memory floor {row['memory_floor_us']:.0f} us, "
            f"compute floor {row['compute_floor_us']:.0f} us"
        )
        for name, multiple in row["x_floor"].items():
            lines.append(
                f"    {name:>6}: {step['ops'][name]} ops, dispatch floor "
                f"{row['dispatch_floor_us'][name]:.0f} us; step = {multiple:.2f}x the floor, "
                f"{row['x_memory_floor'][name]:.2f}x the memory floor"
            )
    return lines


def render(payload: dict[str, Any]) -> str:
    if "context_sweep" in payload:
        return render_sweep(payload["context_sweep"])
    if "prefix_cache_ttft" in payload:
        return render_prefix(payload["prefix_cache_ttft"])
    simulated = " (simulated on the CPU)" if payload["simulated"] else ""
    lines = [
        f"platform {payload['platform']}{simulated}, device {payload['device']}",
        "configurations: "
        + "; ".join(
            f"{name} = refused here"
            if "refused" in c
            else f"{name} = {c['runner']} decode {c['decode']}, mixed {c['mixed']}, "
            f"region {c['eager_region']}"
            for name, c in payload["configurations"].items()
        ),
        *(
            f"  {name}: {reason}"
            for name, c in payload["configurations"].items()
            for reason in c.get("downgrades", [c.get("refused")])
        ),
        "decode-step latency, median us (ratios from the same run):",
    ]
    lines.append(
        f"  {'threads':>7} {'batch':>5} {'eager':>9} {'full':>9} {'narrow':>9} {'wide':>9}"
        f"  {'full/eager':>10} {'narrow/wide':>11}"
    )
    for row in payload["decode"]:
        m, r = row["median_us"], row["ratios"]
        times = " ".join(
            _cell(m.get(name), 9, ".0f") for name in ("eager", "full", "narrow", "wide")
        )
        lines.append(
            f"  {row['threads']:>7} {row['batch_size']:>5} {times}  "
            f"{_cell(r['full/eager'], 10, '.3f')} {_cell(r['narrow/wide'], 11, '.3f')}"
        )
    lines.extend(_render_limit(payload["limit"]))
    cap = payload["capture"]
    ratio = cap["held/eager_step_peak"]
    lines.append(
        f"capture: {len(cap['seconds_per_graph'])} graphs (every size and bucket, as dsv4 serve "
        f"captures) in {cap['total_s']:.2f}s, "
        f"{_mib(cap['held_bytes'])} held by captures "
        f"({'n/a' if ratio is None else f'{ratio}x'} the {_mib(cap['eager_step_peak_bytes'])}"
        " peak of an eager step of the largest size and context)"
    )
    gen = payload["generation"]
    tps = ", ".join(f"{k} {v:.1f}" for k, v in gen["tokens_per_s"].items())
    lines.append(f"generation tokens/s: {tps}")
    run = gen["run_capture"]
    lines.append(
        f"  dsv4 run of these {gen['prompts']} prompts captures {run['graphs']} graphs "
        f"(what their steps can reach) in {run['total_s']:.2f}s"
    )
    if "ratio_engine/transformers" in gen:
        devices = gen["devices"]
        lines.append(
            f"  engine/transformers = {gen['ratio_engine/transformers']:.2f}x, engine on "
            f"{devices['engine']}, transformers on {devices['transformers']} "
            f"(same tokens as its uncached forward: {gen['same_tokens_as_uncached_forward']}, "
            f"as its generate: {gen['same_tokens_as_generate']})"
        )
    if payload["tensor_parallel_size"] > 1:
        lines.append(
            f"tensor parallel size {payload['tensor_parallel_size']}: rank 0 spent "
            f"{payload['collective_share_of_decode']:.1%} of the decode timing in collectives"
        )
    lines.append(f"method: {payload['method']}")
    return "\n".join(lines)
