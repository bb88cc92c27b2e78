"""Is a configuration equal to eager? Run it and an eager engine on the same prompts and compare.

This is the measurement behind ``dsv4 matrix``, the cross-strategy property suite and the
platform conformance kit. A configuration is run through the real engine and runner; every
``execute`` call's logits are recorded, and the run is compared with an eager run (graph mode
``NONE``) of the same model on the same prompts.

Invariants:
- The scheduler is deterministic, so two runs that sample the same tokens issue the same steps;
  logits are compared step by step for as long as the steps agree, and ``max_abs_diff`` is the
  largest difference seen there.
- ``status`` is exactly one of ``equal`` (same tokens, logits within tolerance), ``mismatch``,
  ``refused`` (the resolution refused the combination) or ``audit-error`` (the capture audit
  reported an unstable read).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import torch

from dsv4 import DeepseekV4ForCausalLM
from dsv4.metadata import ScheduledChunk
from graphs.errors import CaptureAuditError
from runners.base import ModelRunner
from runners.engine import LLM, SamplingParams
from runners.errors import ResolutionError
from runners.resolution import Resolution
from runners.serving import EngineSpec, build_engine

__all__ = ["Comparison", "RecordingExecutor", "Status", "Trace", "compare_to_eager", "run_trace"]

StepKey = tuple[tuple[int, int, int], ...]


class Status(enum.Enum):
    EQUAL = "equal"
    MISMATCH = "mismatch"
    REFUSED = "refused"
    AUDIT_ERROR = "audit-error"


class RecordingExecutor:
    """Wraps a runner as a ``StepExecutor`` and records every step's key and logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[tuple[StepKey, torch.Tensor]] = []

    @property
    def max_rows(self) -> int:
        return self.runner.max_rows

    @property
    def max_num_tokens(self) -> int:
        return self.runner.max_num_tokens

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def max_blocks_per_row(self) -> int:
        return self.runner.max_blocks_per_row

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        logits = self.runner.execute(chunks, token_ids)
        key = tuple((c.row, c.start_position, c.num_tokens) for c in chunks)
        self.steps.append((key, logits.detach().clone()))
        return logits


@attrs.frozen(kw_only=True)
class Trace:
    """What one run produced: tokens per prompt and the logits of every step."""

    resolution: Resolution
    outputs: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[StepKey, torch.Tensor], ...]
    num_graphs: int
    num_eager_breaks: int


@attrs.frozen(kw_only=True)
class Comparison:
    """The verdict on one configuration against eager."""

    status: Status
    max_abs_diff: float | None = None
    detail: str = ""
    resolution: Resolution | None = None


def run_trace(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    max_num_batched_tokens: int | None = None,
) -> Trace:
    """Run ``prompts`` through the engine ``spec`` describes, recording every step."""
    engine = build_engine(spec, model=model)
    recorder = RecordingExecutor(engine.runner)
    llm = LLM(recorder, max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.generate(prompts, params)
    return Trace(
        resolution=engine.resolution,
        outputs=tuple(o.output_ids for o in outputs),
        steps=tuple(recorder.steps),
        num_graphs=engine.runner.num_graphs,
        num_eager_breaks=engine.runner.num_eager_breaks,
    )


def _max_diff(a: Trace, b: Trace) -> float:
    worst = 0.0
    for (key_a, logits_a), (key_b, logits_b) in zip(a.steps, b.steps, strict=False):
        if key_a != key_b:
            break
        worst = max(worst, float((logits_a - logits_b).abs().max()))
    return worst


def compare_to_eager(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eager: Trace | None = None,
    atol: float = 1e-5,
    max_num_batched_tokens: int | None = None,
) -> Comparison:
    """Run ``spec`` and compare it with ``eager`` (computed here when not given)."""
    if eager is None:
        eager = run_trace(
            attrs.evolve(spec, cudagraph_mode="NONE", eager_region="auto", unsafe_region=False),
            model,
            prompts,
            params,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    try:
        trace = run_trace(
            spec, model, prompts, params, max_num_batched_tokens=max_num_batched_tokens
        )
    except ResolutionError as exc:
        return Comparison(status=Status.REFUSED, detail=str(exc))
    except CaptureAuditError as exc:
        return Comparison(status=Status.AUDIT_ERROR, detail=str(exc))
    diff = _max_diff(trace, eager)
    if trace.outputs != eager.outputs:
        first = next(
            i for i, (x, y) in enumerate(zip(trace.outputs, eager.outputs, strict=True)) if x != y
        )
        return Comparison(
            status=Status.MISMATCH,
            max_abs_diff=diff,
            detail=f"prompt {first}: tokens {list(trace.outputs[first])} != eager "
            f"{list(eager.outputs[first])}",
            resolution=trace.resolution,
        )
    status = Status.EQUAL if diff <= atol else Status.MISMATCH
    detail = "" if status is Status.EQUAL else f"logits differ by {diff:.3g} > {atol:g}"
    return Comparison(status=status, max_abs_diff=diff, detail=detail, resolution=trace.resolution)
