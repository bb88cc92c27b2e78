"""The conformance kit's parallel pass: every configuration allowed at N ranks generates the
single-rank eager output.

One parallel run (``runners.distributed.run_local``) covers every configuration: each rank builds
its share of the same fixed-seed model and runs the configurations in turn through the engine,
and rank 0 hands back the traces; the parent compares each with the eager run of the whole model
on one rank. The platform crosses to the ranks pickled, simulated or not (so the test class's
platform must be picklable, as an instance of a class defined at module level is).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import attrs

from dsv4 import DeepseekV4Config
from dsv4.parallel import TensorParallel
from dsv4.testing import random_model
from platforms.base import Platform
from runners import SamplingParams
from runners.distributed import process_group_backend, run_local
from runners.measure.equivalence import run_trace
from runners.testing.checks import (
    STEP_BUDGET,
    Configuration,
    Workload,
    engine_spec,
    expect,
    first_difference,
    platform_label,
)

__all__ = ["parallel_pass"]


def parallel_pass(
    platform: Platform,
    configurations: Sequence[Configuration],
    *,
    size: int,
    atol: float | None,
    max_new_tokens: int,
) -> None:
    """Run ``configurations`` on ``size`` ranks of ``platform`` (simulated ranks run on the
    CPU tape) and fail, naming the first configuration, unless each generates the eager tokens
    of one rank with logits within ``atol``."""
    config, seed = DeepseekV4Config.tiny(), 0
    prompts = ((7, 3, 11, 5, 2), tuple(range(40, 53)))
    workload = Workload.build(platform, config, prompts, seed=seed, max_new_tokens=max_new_tokens)
    job = argparse.Namespace(
        platform=platform,
        configurations=list(configurations),
        size=size,
        prompts=prompts,
        seed=seed,
        max_new_tokens=max_new_tokens,
    )
    traces = run_local(_run_configurations, job, size, process_group_backend(platform))["traces"]
    for configuration in configurations:
        label = f"{platform_label(platform)} at tensor parallel size {size}: {configuration}"
        trace = traces[str(configuration)]
        if isinstance(trace, str):
            expect(False, f"{label}: raised {trace}")
        difference = first_difference(trace, workload.eager, prompts, atol=atol)
        expect(difference is None, f"{label}: {difference}")


def _run_configurations(job: argparse.Namespace) -> dict[str, Any]:
    """One rank: its share of the model, then every configuration in turn (each rank in the
    same order, so their collectives pair up); a configuration that raises is recorded as its
    one-line error."""
    platform = job.platform
    parallel = TensorParallel.from_default_group()
    model = random_model(DeepseekV4Config.tiny(), job.seed, platform.device, parallel=parallel)
    params = SamplingParams(max_tokens=job.max_new_tokens)
    traces: dict[str, Any] = {}
    for configuration in job.configurations:
        spec = attrs.evolve(
            engine_spec(platform),
            runner=configuration.runner,
            cudagraph_mode=configuration.mode,
            eager_region=configuration.region,
            tensor_parallel_size=job.size,
        )
        try:
            traces[str(configuration)] = run_trace(
                spec, model, job.prompts, params, max_num_batched_tokens=STEP_BUDGET
            )
        except Exception as exc:  # reported by the parent, naming the configuration
            traces[str(configuration)] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return {"traces": traces}
