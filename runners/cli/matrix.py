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
from pathlib import Path
from typing import Any

from platforms import platform_names
from runners.cli.options import (
    SIMULATE_HELP,
    add_capacity_options,
    add_dtype_option,
    add_parallel_option,
    add_quantization_option,
    capacity_fields,
    parse_positive_int_list,
    parse_token_ids,
)
from runners.cli.progress import Progress
from runners.cli.values import at_least, non_negative_float
from runners.measure.matrix import MatrixOptions, run_matrix

__all__ = ["add_arguments", "execute", "exit_code", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="DIR", help="default: the built-in tiny model")
    add_dtype_option(parser)
    add_quantization_option(parser)
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
        "5e-5 for float32 on the CPU, 1e-3 on a GPU, 1e-2 float16, 5e-2 bfloat16)",
    )
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch CPU threads (default: 1 up to hidden size 512, else one per core)",
    )
    add_capacity_options(parser)
    add_parallel_option(parser)


def parallel_platforms(args: argparse.Namespace) -> list[str]:
    """The platforms the matrix covers (for ``--tensor-parallel-size``'s process group)."""
    return list(dict.fromkeys(args.platform or platform_names()))


def execute(args: argparse.Namespace) -> dict[str, Any]:
    progress = Progress.for_terminal(json_output=args.json)
    options = MatrixOptions(
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        quantization=args.quantization,
        dtype=args.dtype,
        platforms=tuple(args.platform or ()),
        simulate=args.simulate,
        unsafe_region=args.unsafe_region,
        max_new_tokens=args.max_new_tokens,
        capture_sizes=tuple(args.capture_sizes),
        atol=args.atol,
        threads=args.threads,
        capacity=capacity_fields(args),
        **({"prompts": tuple(map(tuple, args.prompt_ids))} if args.prompt_ids else {}),
    )
    payload = run_matrix(options, progress.update)
    progress.done(f"{len(payload['cells'])} cells, {payload['distinct_runs']} distinct runs")
    return {**payload, "report_only": args.report_only}


def exit_code(payload: dict[str, Any]) -> int:
    """1 when any cell failed and ``--report-only`` is off, else 0."""
    return 1 if payload["failed_cells"] and not payload["report_only"] else 0


def _label(platform: object, simulated: bool) -> str:
    return f"{platform}{'*' if simulated else ''}"


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
