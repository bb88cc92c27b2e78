"""Every runner x eager region x graph mode on some platforms, each compared with eager.

``run_matrix`` covers each platform named (every registered one by default), simulated where
asked or where it is not available here. Invariants:
- Each platform is compared with an eager run of its own (graph mode ``NONE``), on its own
  device; a cell is equal when it sampled the same greedy tokens and its logits are within the
  tolerance (``atol``, else ``equality_tolerance`` of the reference's device and dtype).
- Cells whose resolution is the same (device, runner, modes, region) share one run.
- Every cell has exactly one status (``runners.measure.equivalence.Status``); the failing ones
  are mismatch and error, and audit-error unless unsafe regions were asked for (then catching
  them is what the run is for). ``failed_cells`` counts them.
- The lists of runners, regions and modes are their single definitions' (``RUNNERS``,
  ``STRATEGIES``, ``CUDAGraphMode``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from dsv4.dtypes import dtype_name
from graphs import STRATEGIES
from platforms import get_platform, platform_names
from runners.engine import SamplingParams
from runners.errors import ResolutionError
from runners.measure.equivalence import Comparison, Trace, judge, run_configuration, run_trace
from runners.modes import CUDAGraphMode
from runners.resolution import RUNNERS
from runners.spec import (
    EngineSpec,
    build_model,
    compute_dtype_of,
    require_dtype,
    resolve_platform,
    resolve_spec,
)

__all__ = ["DEFAULT_PROMPTS", "MatrixOptions", "run_matrix"]

RUNNER_NAMES = tuple(RUNNERS)
REGION_NAMES = tuple(region.name for region in STRATEGIES)
MODE_NAMES = tuple(mode.name for mode in CUDAGraphMode)
DEFAULT_PROMPTS = ((7, 3, 11, 5, 2), tuple(range(40, 61)), tuple(range(100, 137)))
MATRIX_FIRST_CONTEXT_BUCKET = 16
"""The matrix's smallest context bucket (unless given): small, so the default prompts cross
bucket boundaries mid-generation and every cell covers graphs of several context widths."""


@attrs.frozen(kw_only=True)
class MatrixOptions:
    """What the matrix covers and how it judges."""

    checkpoint: Path | None = None
    quantization: str = "auto"
    """How a quantized checkpoint loads (``EngineSpec.quantization``)."""
    dtype: str = "auto"
    """The compute dtype (``EngineSpec.dtype``); every platform runs the one model in it."""
    platforms: tuple[str, ...] = ()
    """Platform names; empty for every registered platform."""
    simulate: bool = False
    prompts: tuple[tuple[int, ...], ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 8
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    unsafe_region: bool = False
    atol: float | None = None
    threads: int | None = None
    capacity: dict[str, Any] = attrs.field(factory=dict)
    """``EngineSpec`` capacity fields (``max_model_len``, ``max_num_tokens``, …); the token
    budget defaults to at least the largest capture size."""


def run_matrix(options: MatrixOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every cell; return the payload ``dsv4 matrix`` prints (``progress`` gets a line
    before each run)."""
    prompts = [list(p) for p in options.prompts]
    params = SamplingParams(max_tokens=options.max_new_tokens, ignore_eos=True, detokenize=False)
    sizes = options.capture_sizes
    base = EngineSpec(
        checkpoint=options.checkpoint,
        quantization=options.quantization,
        dtype=options.dtype,
        capture_sizes=sizes,
        unsafe_region=options.unsafe_region,
        threads=options.threads,
        **{
            "max_num_tokens": max(64, *sizes),
            "first_context_bucket": MATRIX_FIRST_CONTEXT_BUCKET,
            **options.capacity,
        },
    )
    platforms = _platforms(options.platforms, simulate=options.simulate)
    dtype = compute_dtype_of(base)
    for platform, simulated in platforms:  # refuse before loading anything
        require_dtype(resolve_platform(platform, simulated=simulated), dtype)
    progress("loading model")
    model = build_model(base)
    references: dict[tuple[str, bool], Trace] = {}
    for platform, simulated in platforms:
        progress(f"eager reference on {_label(platform, simulated)}")
        eager = attrs.evolve(
            base, platform=platform, simulate=simulated, cudagraph_mode="NONE", unsafe_region=False
        )
        references[platform, simulated] = run_trace(eager, model, prompts, params)
    cells: list[Cell] = [
        (platform, simulated, runner, region, mode)
        for (platform, simulated), runner, region, mode in itertools.product(
            platforms, RUNNER_NAMES, REGION_NAMES, MODE_NAMES
        )
    ]
    groups = _group_by_run(base, cells)
    verdicts: dict[Cell, Comparison] = {}
    for index, (spec, members) in enumerate(groups, 1):
        progress(
            f"run {index}/{len(groups)}: {_label(spec.platform, spec.simulate)} "
            f"{spec.runner} {spec.eager_region} {spec.cudagraph_mode}"
        )
        outcome = run_configuration(spec, model, prompts, params)
        for cell in members:
            verdicts[cell] = _verdict(outcome, references[cell[0], cell[1]], options.atol)
    rows = [_cell_payload(cell, verdicts[cell]) for cell in cells]
    counts = collections.Counter(row["status"] for row in rows)
    # an audit error fails the gate unless unsafe regions were asked for (then catching them is
    # what the run is for); a mismatch or an error always does
    failing = {"mismatch", "error"} | (set() if options.unsafe_region else {"audit-error"})
    return {
        "failed_cells": sum(row["status"] in failing for row in rows),
        "prompts": prompts,
        "max_new_tokens": options.max_new_tokens,
        "capture_sizes": list(sizes),
        "dtype": dtype_name(model.compute_dtype),
        "unsafe_region": options.unsafe_region,
        "references": [
            _reference_payload(platform, simulated, trace, _atol(options.atol, trace))
            for (platform, simulated), trace in references.items()
        ],
        "counts": dict(counts),
        "distinct_runs": len(groups),
        "cells": rows,
    }


Cell = tuple[str, bool, str, str, str]
"""(platform, simulated, runner, eager region, graph mode)."""


def _platforms(names: Sequence[str], *, simulate: bool) -> list[tuple[str, bool]]:
    """(name, simulated) for each platform to cover: simulated if asked or not available here."""
    chosen = list(dict.fromkeys(names or platform_names()))
    return [(name, simulate or not get_platform(name).is_available()) for name in chosen]


def _label(platform: object, simulated: bool) -> str:
    return f"{platform}{'*' if simulated else ''}"


def _atol(explicit: float | None, reference: Trace) -> float:
    """``--atol`` when given, else the tolerance of the reference's device and dtype."""
    return reference.tolerance if explicit is None else explicit


def _verdict(outcome: Trace | Comparison, reference: Trace, atol: float | None) -> Comparison:
    """A run's verdict against its cell's eager ``reference`` (a refusal or an audit error
    stands as it is)."""
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
        "prefix_cache_hit_tokens": verdict.prefix_cache_hit_tokens,
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
        "prefix_cache_hit_tokens": trace.prefix_cache_hit_tokens,
    }


def _run_key(spec: EngineSpec) -> tuple[Any, ...]:
    """Cells whose resolution is the same run once: the key is what the run depends on."""
    try:
        r = resolve_spec(spec)
    except ResolutionError as exc:
        return ("refused", spec.platform, str(exc))
    return (r.platform.device_type, r.runner.name, r.decode_mode, r.mixed_mode, r.eager_region)
