"""Run every runner x eager region x graph mode and compare each with eager.

Each cell is one of: equal (same greedy tokens, logits within --atol of eager), refused (the
resolution refuses the combination, with its reason), audit-error (the capture audit caught an
unstable read) or mismatch, with the largest logit difference against eager. Platforms not
available here are simulated on the CPU with the tape backend. Cells that resolve to the same
runner, modes and region share one run.
Example: dsv4 matrix --unsafe-region
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runners.cli.options import MODE_CHOICES, RUNNER_CHOICES, parse_int_list
from runners.cli.progress import Progress
from runners.cli.run import apply_threads

if TYPE_CHECKING:
    from runners.serving import EngineSpec

__all__ = ["add_arguments", "execute", "render"]

REGIONS = ("full-graph", "narrow", "wide", "no-graph")
RUNNERS = tuple(r for r in RUNNER_CHOICES if r != "auto")
MODES = tuple(m for m in MODE_CHOICES if m != "auto")
DEFAULT_PROMPTS = ([7, 3, 11, 5, 2], list(range(40, 61)), list(range(100, 137)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="default: the built-in tiny model")
    parser.add_argument(
        "--platform",
        action="append",
        help="platform to cover (repeatable; default: every registered platform)",
    )
    parser.add_argument(
        "--unsafe-region",
        action="store_true",
        help="run regions narrower than required instead of refusing them",
    )
    parser.add_argument(
        "--prompt-ids",
        action="append",
        type=parse_int_list,
        metavar="ID,ID,...",
        help="prompts (repeatable; default: three prompts of 5, 21 and 37 tokens)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=8, help="default: 8")
    parser.add_argument(
        "--capture-sizes",
        type=parse_int_list,
        default=[1, 2, 4, 8, 16],
        metavar="N,N,...",
        help="default: 1,2,4,8,16",
    )
    parser.add_argument("--atol", type=float, default=1e-5, help="logit tolerance (1e-5)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _platforms(names: list[str] | None) -> list[tuple[str, bool]]:
    """(name, simulated) for each platform to cover."""
    from platforms import get_platform, platform_names

    chosen = names or list(platform_names())
    return [(name, not get_platform(name).is_available()) for name in chosen]


def execute(args: argparse.Namespace) -> dict[str, Any]:
    from runners.engine import SamplingParams
    from runners.equivalence import Comparison, compare_to_eager, run_trace
    from runners.serving import EngineSpec, build_model

    apply_threads(args.threads)
    progress = Progress.for_terminal(json_output=args.json)
    prompts = args.prompt_ids or [list(p) for p in DEFAULT_PROMPTS]
    params = SamplingParams(max_tokens=args.max_new_tokens)
    sizes = tuple(args.capture_sizes)
    base = EngineSpec(
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        capture_sizes=sizes,
        max_num_tokens=max(64, *sizes),
    )
    progress.update("loading model")
    model = build_model(base)
    eager = run_trace(attrs.evolve(base, cudagraph_mode="NONE"), model, prompts, params)
    cells: list[dict[str, Any]] = []
    runs: dict[tuple[Any, ...], Comparison] = {}
    combos = list(itertools.product(_platforms(args.platform), RUNNERS, REGIONS, MODES))
    for index, ((platform, simulated), runner, region, mode) in enumerate(combos, 1):
        progress.update(f"cell {index}/{len(combos)}: {platform} {runner} {region} {mode}")
        spec = attrs.evolve(
            base,
            platform=platform,
            simulate=simulated,
            runner=runner,
            eager_region=region,
            cudagraph_mode=mode,
            unsafe_region=args.unsafe_region,
        )
        key = _run_key(spec)
        if key not in runs:
            runs[key] = compare_to_eager(spec, model, prompts, params, eager=eager, atol=args.atol)
        verdict = runs[key]
        resolution = verdict.resolution
        cells.append(
            {
                "platform": platform,
                "simulated": simulated,
                "runner": runner,
                "eager_region": region,
                "cudagraph_mode": mode,
                "resolved": None
                if resolution is None
                else {
                    "decode": resolution.decode_mode.name,
                    "mixed": resolution.mixed_mode.name,
                    "eager_region": resolution.eager_region.name,
                },
                "status": verdict.status.value,
                "max_abs_diff": verdict.max_abs_diff,
                "detail": verdict.detail,
            }
        )
    progress.done(f"{len(cells)} cells, {len(runs)} distinct runs")
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    return {
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "capture_sizes": list(sizes),
        "unsafe_region": args.unsafe_region,
        "atol": args.atol,
        "eager_outputs": [list(o) for o in eager.outputs],
        "counts": counts,
        "distinct_runs": len(runs),
        "cells": cells,
    }


def _run_key(spec: EngineSpec) -> tuple[Any, ...]:
    """Cells whose resolution is the same run once: the key is what the run depends on."""
    from runners.errors import ResolutionError
    from runners.serving import resolve_spec

    try:
        r = resolve_spec(spec)
    except ResolutionError as exc:
        return ("refused", spec.platform, str(exc))
    return (r.platform.device_type, r.runner.name, r.decode_mode, r.mixed_mode, r.eager_region)


def render(payload: dict[str, Any]) -> str:
    header = f"{'platform':<14}{'runner':<8}{'region':<12}{'mode':<20}{'resolved':<32}result"
    lines = [header, "-" * len(header)]
    for cell in payload["cells"]:
        platform = cell["platform"] + ("*" if cell["simulated"] else "")
        resolved = cell["resolved"]
        resolved_text = (
            "-"
            if resolved is None
            else f"{resolved['decode']}/{resolved['mixed']} {resolved['eager_region']}"
        )
        result = cell["status"]
        if cell["max_abs_diff"] is not None:
            result += f" (max diff {cell['max_abs_diff']:.2g})"
        if cell["status"] in ("refused", "audit-error", "mismatch") and cell["detail"]:
            result += f": {cell['detail'][:110]}"
        lines.append(
            f"{platform:<14}{cell['runner']:<8}{cell['eager_region']:<12}"
            f"{cell['cudagraph_mode']:<20}{resolved_text:<32}{result}"
        )
    counts = ", ".join(f"{n} {status}" for status, n in sorted(payload["counts"].items()))
    lines.append(f"* simulated on the CPU. {counts}; {payload['distinct_runs']} distinct runs.")
    return "\n".join(lines)
