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
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runners.cli.errors import UsageError
from runners.cli.options import PLATFORM_HELP, SIMULATE_HELP, parse_positive_int_list
from runners.cli.progress import Progress
from runners.cli.values import at_least

if TYPE_CHECKING:
    from runners.benchmark import GenerationThroughput
    from runners.serving import EngineSpec

__all__ = ["add_arguments", "execute", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="default: the built-in tiny model")
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
        default=[1, 2],
        metavar="N,N,...",
        help="torch thread counts (default: 1,2)",
    )
    parser.add_argument(
        "--repeats", type=at_least(1), default=50, help="timed rounds (default: 50)"
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


def _validate(args: argparse.Namespace) -> None:
    if max(args.batch_sizes) > 16:
        raise UsageError("--batch-sizes are at most 16 (the runner's block-table rows)")


def execute(args: argparse.Namespace) -> dict[str, Any]:
    from runners.serving import EngineSpec

    _validate(args)
    progress = Progress.for_terminal(json_output=args.json)
    base = EngineSpec(
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        platform=args.platform,
        simulate=args.simulate,
    )
    spec = attrs.evolve(base, capture_sizes=tuple(sorted(set(args.batch_sizes) | {16})))
    progress.update("capturing every default size")
    payload: dict[str, Any] = {"checkpoint": args.checkpoint, **_capture(base)}
    payload["method"] = _METHOD
    progress.update("timing decode steps")
    payload["configurations"] = _configurations(spec)
    runnable = [n for n, c in payload["configurations"].items() if "refused" not in c]
    payload["decode"] = _decode(spec, args, runnable)
    progress.update("timing generation")
    payload["generation"] = _generation(base, spec, args)
    progress.done("benchmark done")
    return payload


def _capture(base: EngineSpec) -> dict[str, Any]:
    """The platform measured, and the capture cost of every default size against an eager step."""
    import torch

    from runners.benchmark import capture_cost, captures_held_bytes, eager_step_peak_bytes
    from runners.serving import build_engine

    torch.set_num_threads(1)
    engine = build_engine(base)
    runner = engine.runner
    cost = capture_cost(runner, functools.partial(captures_held_bytes, runner))
    eager_runner = build_engine(attrs.evolve(base, cudagraph_mode="NONE")).runner
    peak = eager_step_peak_bytes(eager_runner, max(runner.capture_sizes.sizes))
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


_COLUMNS = ("eager", "full", "narrow", "wide")
_RATIOS = (("full", "eager"), ("narrow", "eager"), ("wide", "eager"), ("narrow", "wide"))


def _configurations(spec: EngineSpec) -> dict[str, dict[str, Any]]:
    """What each timed configuration resolved to on the platform measured, with the reasons of
    any downgrade (a column named ``full`` may run PIECEWISE decode graphs where the platform
    or runner forbids FULL ones)."""
    from runners.benchmark import DECODE_CONFIGS
    from runners.errors import ResolutionError
    from runners.serving import resolve_spec

    configurations: dict[str, dict[str, Any]] = {}
    for name, (runner, mode, region) in DECODE_CONFIGS.items():
        try:
            resolution = resolve_spec(
                attrs.evolve(spec, runner=runner, cudagraph_mode=mode, eager_region=region)
            )
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


def _decode(spec: EngineSpec, args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    """Median decode-step latency per configuration in ``names`` (those the platform does not
    refuse), thread count and batch size; a ratio with a refused side is ``None``."""
    from runners.benchmark import decode_latency, decode_runners
    from runners.serving import build_model

    runners = decode_runners(spec, lambda: build_model(spec), names)
    latencies = decode_latency(
        runners, batch_sizes=args.batch_sizes, threads=args.threads, repeats=args.repeats
    )
    return [
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


def _generation(base: EngineSpec, spec: EngineSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Generation tokens per second (median of rounds), and transformers' when asked."""
    import torch

    from runners.benchmark import engine_throughput
    from runners.serving import build_model

    torch.set_num_threads(1)
    prompts = [
        [(11 * p + 3 * i) % 256 for i in range(8 + 4 * p)] for p in range(args.generate_prompts)
    ]
    ours, our_tokens = engine_throughput(base, build_model(spec), prompts, args.max_new_tokens)
    rounds: dict[str, list[float]] = {"engine": []}
    theirs: Callable[[], GenerationThroughput] | None = None
    if args.vs_transformers:
        from runners.hf_baseline import transformers_baseline

        baseline = transformers_baseline(base.checkpoint, prompts, args.max_new_tokens)
        theirs = baseline.round
        rounds["transformers"] = []
    for _ in range(args.rounds):
        rounds["engine"].append(ours().tokens_per_s)
        if theirs is not None:
            rounds["transformers"].append(theirs().tokens_per_s)
    generation: dict[str, Any] = {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": {k: round(statistics.median(v), 2) for k, v in rounds.items()},
    }
    if theirs is not None:
        tps = generation["tokens_per_s"]
        generation["ratio_engine/transformers"] = round(tps["engine"] / tps["transformers"], 3)
        generation["same_tokens_as_generate"] = our_tokens == baseline.generate_tokens
        generation["same_tokens_as_uncached_forward"] = our_tokens == baseline.uncached_tokens
    return generation


_METHOD = (
    "decode: one runner per configuration over identical weights, the same requests prefilled "
    "in each, single decode steps timed interleaved (rotating order), each from a drained device "
    "until the device finished it (CUDA events on a GPU), medians; generation: greedy, graphs "
    "captured beforehand, alternating rounds, medians; one thread unless stated"
)


def _cell(value: float | None, width: int, spec: str) -> str:
    """A right-aligned table cell; ``-`` for a configuration the platform refused."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def _mib(nbytes: int | None) -> str:
    """``nbytes`` in MiB, or ``n/a`` where the pool reports no size (``None``, as on CUDA)."""
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def render(payload: dict[str, Any]) -> str:
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
    cap = payload["capture"]
    ratio = cap["held/eager_step_peak"]
    lines.append(
        f"capture: {len(cap['seconds_per_graph'])} graphs in {cap['total_s']:.2f}s, "
        f"{_mib(cap['held_bytes'])} held by captures "
        f"({'n/a' if ratio is None else f'{ratio}x'} the {_mib(cap['eager_step_peak_bytes'])}"
        " peak of an eager step of the largest size)"
    )
    gen = payload["generation"]
    tps = ", ".join(f"{k} {v:.1f}" for k, v in gen["tokens_per_s"].items())
    lines.append(f"generation tokens/s: {tps}")
    if "ratio_engine/transformers" in gen:
        lines.append(
            f"  engine/transformers = {gen['ratio_engine/transformers']:.2f}x "
            f"(same tokens as its uncached forward: {gen['same_tokens_as_uncached_forward']}, "
            f"as its generate: {gen['same_tokens_as_generate']})"
        )
    lines.append(f"method: {payload['method']}")
    return "\n".join(lines)
