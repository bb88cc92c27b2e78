"""Is a configuration equal to eager? Run it and an eager engine on the same prompts and compare.

This is the measurement behind ``dsv4 matrix``, the cross-strategy property suite and the
platform conformance kit. A configuration is run through the real engine and runner; every
``execute`` call's logits are recorded, and the run is compared with an eager run (graph mode
``NONE``) of the same model on the same prompts.

Invariants:
- The scheduler is deterministic, so two runs that sample the same tokens issue the same steps
  (the eager run takes the configuration's engine settings, the prefix cache included: a hit
  changes which steps run, never what they compute);
  logits are compared step by step for as long as the steps agree, and ``max_abs_diff`` is the
  largest difference seen there.
- Logits are compared on the CPU in float32, whatever device each run used.
- ``status`` is exactly one of ``equal`` (same tokens, logits within tolerance), ``mismatch``,
  ``refused`` (the resolution refused the combination), ``audit-error`` (the capture audit
  reported an unstable read) or ``error`` (the run raised anything else).
- The tolerance, unless a caller overrides it, is ``equality_tolerance`` of the device and dtype
  the runs used: defined there once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import torch

from dsv4 import DeepseekV4ForCausalLM
from graphs.errors import CaptureAuditError
from runners.engine import LLM, EngineLimits, SamplingParams, ScheduledChunk, StepExecutor
from runners.errors import ResolutionError
from runners.resolution import Resolution
from runners.spec import EngineSpec, build_engine

__all__ = [
    "Comparison",
    "RecordingExecutor",
    "Status",
    "Trace",
    "compare_to_eager",
    "equality_tolerance",
    "judge",
    "run_configuration",
    "run_trace",
]

StepKey = tuple[tuple[int, int, int], ...]

_HALF_PRECISION_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
_FULL_PRECISION = (torch.float32, torch.float64)


def equality_tolerance(device_type: str, dtype: torch.dtype) -> float:
    """Largest logit difference from eager that still counts as equal, for a model of ``dtype``
    run on ``device_type`` (a torch device type; ROCm builds of torch report ``cuda``).

    The rule:
    - float32 (and float64) on ``cpu``: 5e-5. The CPU runs graphs with the op tape, which
      replays the very kernels eager calls; what is left is reduction order changed by padding
      a batch to a captured size and the context to its bucket (an eager step attends over its
      exact context, a graph over its bucket's, the extra keys masked): measured on the built-in
      model, at most 3.0e-6 from batch padding alone, 1.43e-5 with context buckets.
    - float32 (and float64) on any other device: 1e-3. A padded graph and an unpadded eager step
      have different shapes, and cuBLAS/hipBLAS and the attention kernels are chosen by shape
      (split-K, other tilings, TF32 where it is allowed), so sums are reordered and their
      rounding differs: far more than the tape's, though still well below 1e-3 for logits of a
      few units (not yet measured on a GPU: a first figure, to be tightened from one).
    - float16: 1e-2 and bfloat16: 5e-2, on every device: activations rounded to 11 or 8
      significant bits (an ulp of about 1e-3 and 8e-3 at magnitude 1) turn any reordering into
      whole ulps, which the layers accumulate (measured on the built-in model on the CPU, logits
      up to 4: float16 3.9e-3, bfloat16 0). The bounds are absolute: they assume logits of a few
      units, as the built-in model's; larger logits have proportionally larger ulps.
    Any other dtype raises ``ValueError``: it has no agreed tolerance.
    """
    if dtype in _HALF_PRECISION_TOLERANCE:
        return _HALF_PRECISION_TOLERANCE[dtype]
    if dtype not in _FULL_PRECISION:
        raise ValueError(f"no equality tolerance is defined for logits of a {dtype} model")
    return 5e-5 if device_type == "cpu" else 1e-3


class Status(enum.Enum):
    EQUAL = "equal"
    MISMATCH = "mismatch"
    REFUSED = "refused"
    AUDIT_ERROR = "audit-error"
    ERROR = "error"


class RecordingExecutor:
    """Wraps a runner (or any ``StepExecutor``) as a ``StepExecutor`` and records every step's
    key (row, start, tokens of each chunk) and a copy of its logits."""

    def __init__(self, runner: StepExecutor) -> None:
        self.runner = runner
        self.steps: list[tuple[StepKey, torch.Tensor]] = []

    @property
    def limits(self) -> EngineLimits:
        return self.runner.limits

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
    dtype: torch.dtype
    """The model's compute dtype (activations, KV caches and all but the fp32-kept weights)."""
    outputs: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[StepKey, torch.Tensor], ...]
    num_graphs: int
    num_eager_breaks: int
    prefix_cache_hit_tokens: int
    """Prompt tokens found in the prefix cache, so not computed (0 when it is off)."""

    @property
    def tolerance(self) -> float:
        """``equality_tolerance`` of the device and dtype this run used."""
        return equality_tolerance(self.resolution.platform.device_type, self.dtype)


@attrs.frozen(kw_only=True)
class Comparison:
    """The verdict on one configuration against eager."""

    status: Status
    max_abs_diff: float | None = None
    detail: str = ""
    resolution: Resolution | None = None
    prefix_cache_hit_tokens: int | None = None
    """The judged run's ``Trace.prefix_cache_hit_tokens`` (``None`` when nothing ran)."""


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
    llm = LLM(
        recorder,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=spec.enable_prefix_caching,
    )
    outputs = llm.generate(prompts, params)
    cache = llm.stats().prefix_cache
    return Trace(
        resolution=engine.resolution,
        dtype=model.compute_dtype,
        outputs=tuple(o.output_ids for o in outputs),
        steps=tuple(recorder.steps),
        num_graphs=engine.runner.num_graphs,
        num_eager_breaks=engine.runner.num_eager_breaks,
        prefix_cache_hit_tokens=0 if cache is None else cache.hit_tokens,
    )


def _max_diff(a: Trace, b: Trace) -> float:
    """Largest logit difference over the leading steps both runs took alike, on the CPU."""
    worst = 0.0
    for (key_a, logits_a), (key_b, logits_b) in zip(a.steps, b.steps, strict=False):
        if key_a != key_b:
            break
        diff = logits_a.to("cpu", torch.float32) - logits_b.to("cpu", torch.float32)
        worst = max(worst, float(diff.abs().max()))
    return worst


def run_configuration(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
) -> Trace | Comparison:
    """The trace of ``spec``, or the verdict that stopped it: refused, audit-error, or error
    (any other exception, as ``Type: message``, so one broken cell does not end a matrix)."""
    try:
        return run_trace(spec, model, prompts, params)
    except ResolutionError as exc:
        return Comparison(status=Status.REFUSED, detail=str(exc))
    except CaptureAuditError as exc:
        return Comparison(status=Status.AUDIT_ERROR, detail=str(exc))
    except Exception as exc:
        return Comparison(status=Status.ERROR, detail=f"{type(exc).__name__}: {exc}")


def judge(trace: Trace, eager: Trace, *, atol: float | None = None) -> Comparison:
    """``trace`` against ``eager``: equal when both sampled the same tokens and their logits
    differ by at most ``atol`` (default: the looser of the two runs' ``Trace.tolerance``)."""
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
            prefix_cache_hit_tokens=trace.prefix_cache_hit_tokens,
        )
    limit = max(trace.tolerance, eager.tolerance) if atol is None else atol
    status = Status.EQUAL if diff <= limit else Status.MISMATCH
    detail = "" if status is Status.EQUAL else f"logits differ by {diff:.3g} > {limit:g}"
    return Comparison(
        status=status,
        max_abs_diff=diff,
        detail=detail,
        resolution=trace.resolution,
        prefix_cache_hit_tokens=trace.prefix_cache_hit_tokens,
    )


def compare_to_eager(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eager: Trace | None = None,
    atol: float | None = None,
) -> Comparison:
    """Run ``spec`` and ``judge`` it against ``eager`` (computed here when not given)."""
    if eager is None:
        eager_spec = attrs.evolve(
            spec, cudagraph_mode="NONE", eager_region="auto", unsafe_region=False
        )
        eager = run_trace(eager_spec, model, prompts, params)
    outcome = run_configuration(spec, model, prompts, params)
    return outcome if isinstance(outcome, Comparison) else judge(outcome, eager, atol=atol)
