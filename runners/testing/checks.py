"""What the conformance kit runs and how it words a failure, so that a failure needs no debugger.

Every failure the kit reports names the platform (and whether it ran simulated), the runner,
graph mode and eager region, the prompt, and either the first token that differs from eager
(its output index and sequence position, the expected and the generated token) or the
exception (type and message). Checks raise ``AssertionError`` with that message explicitly:
pytest rewrites ``assert`` only in test modules, not in an installed package such as this kit.

Invariants:
- A configuration is run through the real engine and runner
  (``runners.measure.equivalence``), against an eager run (graph mode ``NONE``) of the same
  model, prompts and platform.
- A configuration that raises is a failure with the exception's type and message, never an
  error escaping the kit without the configuration's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.testing import random_model
from platforms.base import Platform
from runners import CacheLayout, Resolution, SamplingParams
from runners.measure.equivalence import Status, Trace, judge, run_trace
from runners.spec import EngineSpec

__all__ = [
    "SIMULATION_SCOPE",
    "STEP_BUDGET",
    "Configuration",
    "Difference",
    "SimulatedRunWarning",
    "Workload",
    "check_configuration",
    "engine_spec",
    "expect",
    "first_difference",
    "platform_label",
    "resolved",
]

SIMULATION_SCOPE = (
    "A simulated run proves the policy on the CPU tape: the resolution and every runner, graph "
    "mode and region it allows generate the eager tokens where captures behave as CUDA graphs "
    "do (fixed addresses, frozen host decisions, recording is not execution), so a wrong flag, "
    "a wrong resolution or a region too narrow for a runner fails. It cannot refute a claim "
    "whose failure needs the device's own kernels or graphs (a region narrower than the "
    "device's graph capture replays correctly, a graph backend that replays wrongly): only a "
    "run on the device can."
)
STEP_BUDGET = 7
"""Tokens per step: prefill chunks up to 7 tokens, so padded graphs and eager steps above the
largest captured size (4) both occur."""


class SimulatedRunWarning(UserWarning):
    """The kit ran a platform's policy simulated on the CPU tape, not on its device."""


def expect(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` (an ``assert`` that survives
    installation, where pytest does not rewrite asserts)."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    if not condition:
        raise AssertionError(message)


def platform_label(platform: Platform) -> str:
    """``platform NAME (simulated on the CPU tape)`` or ``platform NAME (on its DEVICE device)``."""
    where = (
        "simulated on the CPU tape" if platform.simulated else f"on its {platform.device} device"
    )
    return f"platform {platform.name} ({where})"


def resolved(resolution: Resolution) -> str:
    """What a resolution runs, in words: ``decode MODE, mixed MODE, region NAME``."""
    return (
        f"decode {resolution.decode_mode.name}, mixed {resolution.mixed_mode.name}, "
        f"region {resolution.eager_region.name}"
    )


@attrs.frozen(kw_only=True)
class Configuration:
    """One (runner, graph mode, eager region) as a user spells it, with what it resolves to."""

    runner: str
    mode: str
    region: str
    resolved: str
    """``resolved(resolution)``: what the resolution made of the request."""

    def __str__(self) -> str:
        return (
            f"runner {self.runner}, graph mode {self.mode}, region {self.region} "
            f"(resolved: {self.resolved})"
        )


@attrs.frozen(kw_only=True)
class Workload:
    """A model on a platform's device, the prompts every configuration runs, and the eager
    reference they are compared with."""

    platform: Platform
    model: DeepseekV4ForCausalLM
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    eager: Trace

    @classmethod
    def build(
        cls,
        platform: Platform,
        config: DeepseekV4Config,
        prompts: Sequence[Sequence[int]],
        *,
        seed: int,
        max_new_tokens: int,
        indexer: str = "random",
        router: str = "random",
    ) -> Workload:
        """Build the model (weights from ``seed``, ``indexer`` and ``router``: see
        ``dsv4.testing.random_model``) and run the eager reference; an eager run that raises is
        an ``AssertionError`` naming the platform."""
        model = random_model(config, seed, platform.device, indexer=indexer, router=router)
        frozen = tuple(tuple(p) for p in prompts)
        params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
        spec = attrs.evolve(engine_spec(platform), cudagraph_mode="NONE")
        try:
            eager = run_trace(spec, model, frozen, params, max_num_batched_tokens=STEP_BUDGET)
        except Exception as exc:
            raise AssertionError(
                f"{platform_label(platform)}: the eager reference run (graph mode NONE) of "
                f"prompts {[list(p) for p in frozen]} raised {type(exc).__name__}: {exc}"
            ) from exc
        return cls(platform=platform, model=model, prompts=frozen, params=params, eager=eager)


def engine_spec(platform: Platform) -> EngineSpec:
    """The kit's engine on ``platform``: small capture sizes, budget and cache layout."""
    return EngineSpec(
        platform=platform,
        capture_sizes=(1, 2, 4),
        max_num_tokens=16,
        layout=CacheLayout(num_blocks=40, block_size=4, max_rows=4, max_blocks_per_row=8),
    )


@attrs.frozen(kw_only=True)
class Difference:
    """How a configuration differs from eager, and the exception it raised, if that is how."""

    detail: str
    error: Exception | None = None

    def __str__(self) -> str:
        return self.detail


def check_configuration(
    configuration: Configuration, workload: Workload, *, atol: float | None
) -> Difference | None:
    """``None`` when ``configuration`` generates the eager tokens with logits within ``atol``
    (``None``: ``equality_tolerance`` of the device and dtype); otherwise how it differs: the
    first differing token, the logits, or the exception."""
    spec = attrs.evolve(
        engine_spec(workload.platform),
        runner=configuration.runner,
        cudagraph_mode=configuration.mode,
        eager_region=configuration.region,
    )
    try:
        trace = run_trace(
            spec,
            workload.model,
            workload.prompts,
            workload.params,
            max_num_batched_tokens=STEP_BUDGET,
        )
    except Exception as exc:
        return Difference(detail=f"raised {type(exc).__name__}: {exc}", error=exc)
    detail = first_difference(trace, workload.eager, workload.prompts, atol=atol)
    return None if detail is None else Difference(detail=detail)


def first_difference(
    trace: Trace, eager: Trace, prompts: Sequence[Sequence[int]], *, atol: float | None
) -> str | None:
    """``None`` when ``trace`` equals ``eager`` within ``atol``; else the first differing token
    (prompt, output index, sequence position, expected, got) or the logit difference."""
    verdict = judge(trace, eager, atol=atol)
    if verdict.status is Status.EQUAL:
        return None
    for index, (got, expected) in enumerate(zip(trace.outputs, eager.outputs, strict=True)):
        if got == expected:
            continue
        at = next(
            (i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
            min(len(got), len(expected)),
        )
        prompt = list(prompts[index])
        return (
            f"prompt {index} {prompt}: first differing token at output {at} (sequence position "
            f"{len(prompt) + at}): expected {_token(expected, at)}, got {_token(got, at)} "
            f"(eager output {list(expected)}, this output {list(got)}; largest logit difference "
            f"up to there {verdict.max_abs_diff:.3g})"
        )
    return f"every prompt generates the eager tokens, but {verdict.detail}"


def _token(output: Sequence[int], at: int) -> str:
    return str(output[at]) if at < len(output) else "end of output"
