"""Run every runner x eager region x graph mode and compare each with eager.

Each cell is one of: equal (same greedy tokens, logits within --atol of eager), refused (the
resolution refuses the combination, with its reason), audit-error (the capture audit caught an
unstable read), mismatch, or error (the run raised), with the largest logit difference against
eager. The command is a gate: it exits 1 when any cell mismatches or errors, or is an
audit-error without --unsafe-region (where audit errors are the expected finding); with
--report-only it always exits 0. Each platform is
compared with an eager run of its own, on its own device; platforms not available here (every
platform, with --simulate) are simulated on the CPU with the tape backend. Cells that resolve to
the same device, runner, modes and region share one run.

Examples:
  dsv4 matrix --unsafe-region
  dsv4 matrix --platform rocm --simulate --json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runners.cli.options import (
    MODE_CHOICES,
    RUNNER_CHOICES,
    SIMULATE_HELP,
    parse_positive_int_list,
    parse_token_ids,
)
from runners.cli.progress import Progress
from runners.cli.values import at_least, non_negative_float
from runners.threads import apply_threads

if TYPE_CHECKING:
    from runners.measure.equivalence import Comparison, Trace
    from runners.spec import EngineSpec

__all__ = ["add_arguments", "execute", "exit_code", "render"]

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
        "--simulate",
        action="store_true",
        help=f"{SIMULATE_HELP}, for every platform covered (one not available here always is)",
    )
    parser.add_argument(
        "--unsafe-region",
        action="store_true",
        help="run regions narrower than required instead of refusing them",
    )
    parser.add_argument(
        "--prompt-ids",
        action="append",
        type=parse_token_ids,
        metavar="ID,ID,...",
        help="prompts (repeatable; default: three prompts of 5, 21 and 37 tokens)",
    )
    parser.add_argument("--max-new-tokens", type=at_least(1), default=8, help="default: 8")
    parser.add_argument(
        "--capture-sizes",
        type=parse_positive_int_list,
        default=[1, 2, 4, 8, 16],
        metavar="N,N,...",
        help="default: 1,2,4,8,16",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 even when cells fail (default: exit 1, so the matrix can gate CI)",
    )
    parser.add_argument(
        "--atol",
        type=non_negative_float,
        default=None,
        help="logit tolerance (default: per platform, from its device and the model's dtype: "
        "1e-5 for float32 on the CPU, 1e-3 on a GPU, 1e-2 float16, 5e-2 bfloat16)",
    )
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch CPU threads (default: 1 up to hidden size 512, else one per core)",
    )


Cell = tuple[str, bool, str, str, str]
"""(platform, simulated, runner, eager region, graph mode)."""


def _platforms(names: list[str] | None, *, simulate: bool) -> list[tuple[str, bool]]:
    """(name, simulated) for each platform to cover: simulated if asked or not available here."""
    from platforms import get_platform, platform_names

    chosen = list(dict.fromkeys(names or platform_names()))
    return [(name, simulate or not get_platform(name).is_available()) for name in chosen]


def execute(args: argparse.Namespace) -> dict[str, Any]:
    from runners.engine import SamplingParams
    from runners.measure.equivalence import run_configuration, run_trace
    from runners.spec import EngineSpec, build_model

    progress = Progress.for_terminal(json_output=args.json)
    prompts = args.prompt_ids or [list(p) for p in DEFAULT_PROMPTS]
    params = SamplingParams(max_tokens=args.max_new_tokens)
    sizes = tuple(args.capture_sizes)
    base = EngineSpec(
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        capture_sizes=sizes,
        max_num_tokens=max(64, *sizes),
        unsafe_region=args.unsafe_region,
    )
    platforms = _platforms(args.platform, simulate=args.simulate)
    progress.update("loading model")
    model = build_model(base)
    apply_threads(args.threads, model.config.hidden_size)
    references: dict[tuple[str, bool], Trace] = {}
    for platform, simulated in platforms:
        progress.update(f"eager reference on {_label(platform, simulated)}")
        eager = attrs.evolve(
            base, platform=platform, simulate=simulated, cudagraph_mode="NONE", unsafe_region=False
        )
        references[platform, simulated] = run_trace(eager, model, prompts, params)
    cells: list[Cell] = [
        (platform, simulated, runner, region, mode)
        for (platform, simulated), runner, region, mode in itertools.product(
            platforms, RUNNERS, REGIONS, MODES
        )
    ]
    groups = _group_by_run(base, cells)
    verdicts: dict[Cell, Comparison] = {}
    for index, (spec, members) in enumerate(groups, 1):
        progress.update(
            f"run {index}/{len(groups)}: {_label(spec.platform, spec.simulate)} "
            f"{spec.runner} {spec.eager_region} {spec.cudagraph_mode}"
        )
        outcome = run_configuration(spec, model, prompts, params)
        for cell in members:
            verdicts[cell] = _verdict(outcome, references[cell[0], cell[1]], args.atol)
    progress.done(f"{len(cells)} cells, {len(groups)} distinct runs")
    rows = [_cell_payload(cell, verdicts[cell]) for cell in cells]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    failing = _failing_statuses(unsafe_region=args.unsafe_region)
    return {
        "failed_cells": sum(row["status"] in failing for row in rows),
        "report_only": args.report_only,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "capture_sizes": list(sizes),
        "unsafe_region": args.unsafe_region,
        "references": [
            _reference_payload(platform, simulated, trace, _atol(args.atol, trace))
            for (platform, simulated), trace in references.items()
        ],
        "counts": counts,
        "distinct_runs": len(groups),
        "cells": rows,
    }


def _failing_statuses(*, unsafe_region: bool) -> frozenset[str]:
    """Statuses that fail the gate: a mismatch or error always; an audit error unless unsafe
    regions were asked for (then catching them is what the run is for)."""
    failing = {"mismatch", "error"}
    if not unsafe_region:
        failing.add("audit-error")
    return frozenset(failing)


def exit_code(payload: dict[str, Any]) -> int:
    """1 when any cell failed (see ``_failing_statuses``) and ``--report-only`` is off, else 0."""
    return 1 if payload["failed_cells"] and not payload["report_only"] else 0


def _label(platform: object, simulated: bool) -> str:
    return f"{platform}{'*' if simulated else ''}"


def _atol(explicit: float | None, reference: Trace) -> float:
    """``--atol`` when given, else the tolerance of the reference's device and dtype."""
    return reference.tolerance if explicit is None else explicit


def _verdict(outcome: Trace | Comparison, reference: Trace, atol: float | None) -> Comparison:
    """A run's verdict against its cell's eager ``reference`` (a refusal or an audit error
    stands as it is)."""
    from runners.measure.equivalence import Trace, judge

    if isinstance(outcome, Trace):
        return judge(outcome, reference, atol=_atol(atol, reference))
    return outcome


def _group_by_run(base: EngineSpec, cells: list[Cell]) -> list[tuple[EngineSpec, list[Cell]]]:
    """``cells`` grouped by the run they need (``_run_key``), in first-seen order, each group
    with the spec of its first cell."""
    groups: dict[tuple[Any, ...], tuple[EngineSpec, list[Cell]]] = {}
    for cell in cells:
        platform, simulated, runner, region, mode = cell
        spec = attrs.evolve(
            base,
            platform=platform,
            simulate=simulated,
            runner=runner,
            eager_region=region,
            cudagraph_mode=mode,
        )
        groups.setdefault(_run_key(spec), (spec, []))[1].append(cell)
    return list(groups.values())


def _cell_payload(cell: Cell, verdict: Comparison) -> dict[str, Any]:
    platform, simulated, runner, region, mode = cell
    resolution = verdict.resolution
    return {
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


def _reference_payload(platform: str, simulated: bool, trace: Trace, atol: float) -> dict[str, Any]:
    return {
        "platform": platform,
        "simulated": simulated,
        "device": trace.resolution.platform.device_type,
        "dtype": str(trace.dtype).removeprefix("torch."),
        "atol": atol,
        "outputs": [list(o) for o in trace.outputs],
    }


def _run_key(spec: EngineSpec) -> tuple[Any, ...]:
    """Cells whose resolution is the same run once: the key is what the run depends on."""
    from runners.errors import ResolutionError
    from runners.spec import resolve_spec

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
        if cell["status"] != "equal" and cell["detail"]:
            result += f": {cell['detail'][:110]}"
        lines.append(
            f"{platform:<14}{cell['runner']:<8}{cell['eager_region']:<12}"
            f"{cell['cudagraph_mode']:<20}{resolved_text:<32}{result}"
        )
    counts = ", ".join(f"{n} {status}" for status, n in sorted(payload["counts"].items()))
    lines.append(f"* simulated on the CPU. {counts}; {payload['distinct_runs']} distinct runs.")
    references = "; ".join(
        f"{_label(r['platform'], r['simulated'])} on {r['device']}, {r['dtype']}, "
        f"atol {r['atol']:g}"
        for r in payload["references"]
    )
    lines.append(f"eager references: {references}.")
    if payload["failed_cells"]:
        consequence = "reported only" if payload["report_only"] else "exit code 1"
        lines.append(f"FAILED: {payload['failed_cells']} cell(s) ({consequence}).")
    return "\n".join(lines)
