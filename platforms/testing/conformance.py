"""``PlatformConformanceTests``: the one base class a platform author subclasses.

Usage (in the author's test suite)::

    from platforms.testing import PlatformConformanceTests

    class TestMyPlatform(PlatformConformanceTests):
        required_region = "wide"                 # capability flags: what the policy must say
        excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

        def make_platform(self) -> Platform:
            return MyPlatform()

The class checks the platform's policy (identity, declared requirements, the resolution it
yields for DeepSeek-V4, its simulation) and runs the cross-strategy property suite on it: for
random tiny models and batches, every (runner, graph mode, eager region) the resolution allows
produces the eager greedy tokens and logits within ``atol`` of eager. The suite runs on the
platform's real device when it is available (and ``run_on_device``), simulated on the CPU with
the tape backend otherwise.

This module is test-time code: unlike the rest of ``platforms`` it imports ``runners`` and
``dsv4`` (to build engines) and needs hypothesis and pytest.
"""

from __future__ import annotations

import abc
import itertools
from typing import Any, ClassVar

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs import BreakableCapture, NarrowRegion, eager_break_during_capture, strategy_from_name
from platforms.base import Platform
from platforms.simulate import simulate
from platforms.testing.strategies import prompt_batches, tiny_configs

__all__ = ["PlatformConformanceTests"]

DSV4 = "DeepseekV4ForCausalLM"
# Each example builds a model and runs every allowed configuration: a twelfth of the active
# profile's examples (2 under ``ci``, 41 under ``thorough``) keeps the suite affordable.
RUNNERS = ("v1", "v2")
MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
REGIONS = ("full-graph", "narrow", "wide", "no-graph")


class PlatformConformanceTests(abc.ABC):
    """Subclass with ``Test...`` name, implement ``make_platform`` and set the flags."""

    # -- capability flags ------------------------------------------------------------------------
    required_region: ClassVar[str] = "full-graph"
    """Name of the eager region the platform's policy requires (``eager_region_strategy``)."""
    excludes_from_v2: ClassVar[frozenset[str]] = frozenset()
    """Architectures the platform excludes from the ModelRunnerV2 default."""
    run_on_device: ClassVar[bool] = True
    """Run the property suite on the real device when available (else always simulated)."""
    atol: ClassVar[float] = 1e-5
    """Largest logit difference from eager that still counts as equal."""
    max_new_tokens: ClassVar[int] = 4

    @abc.abstractmethod
    def make_platform(self) -> Platform:
        """A fresh instance of the platform under test."""

    # -- helpers ---------------------------------------------------------------------------------
    def execution_platform(self) -> Platform:
        """Where the property suite runs: the device if available and allowed, else simulated."""
        platform = self.make_platform()
        if self.run_on_device and platform.is_available():
            return platform
        return simulate(platform)

    def resolve(self, **overrides: Any) -> Any:
        from runners import resolve

        return resolve(DSV4, self.make_platform(), environ={}, **overrides)

    # -- identity and declared policy ----------------------------------------------------------
    def test_identity(self) -> None:
        platform = self.make_platform()
        assert isinstance(platform, Platform)
        assert platform.name and platform.name == platform.name.strip().lower()
        assert isinstance(platform.device_type, str) and platform.device_type
        available = platform.is_available()
        assert isinstance(available, bool)
        if not available:
            assert platform.unavailable_reason().strip()
        assert platform == self.make_platform(), "two instances must compare equal"
        assert hash(platform) == hash(self.make_platform())

    def test_policy_matches_the_declared_capabilities(self) -> None:
        platform = self.make_platform()
        assert platform.eager_region_strategy == strategy_from_name(self.required_region)
        assert platform.eager_region_reason.strip()
        assert platform.v2_excluded_architectures == self.excludes_from_v2
        for architecture in platform.v2_excluded_architectures:
            assert platform.v2_exclusion_reason(architecture).strip()

    def test_simulation_keeps_the_policy_and_runs_on_the_cpu(self) -> None:
        platform = self.make_platform()
        simulated = simulate(platform)
        assert simulated.simulated and simulated.is_available()
        assert simulated.device_type == "cpu"
        assert simulated.name == platform.name
        assert simulated.eager_region_strategy == platform.eager_region_strategy
        assert simulated.v2_excluded_architectures == platform.v2_excluded_architectures

    # -- resolution ------------------------------------------------------------------------------
    def test_default_resolution_follows_the_design(self) -> None:
        from runners import ModelRunnerV1, ModelRunnerV2

        platform = self.make_platform()
        resolution = self.resolve()
        excluded = DSV4 in self.excludes_from_v2
        assert resolution.runner is (ModelRunnerV1 if excluded else ModelRunnerV2)
        base = platform.eager_region_strategy.join(resolution.runner.eager_region_strategy)
        assert resolution.eager_region == base.join(NarrowRegion())
        assert (resolution.decode_mode.name == "FULL") == (base.name == "full-graph")
        assert resolution.mixed_mode.name == "PIECEWISE"
        assert all(isinstance(r, str) and r for r in resolution.reasons)

    @pytest.mark.parametrize("runner", RUNNERS)
    def test_an_explicit_runner_wins(self, runner: str) -> None:
        assert self.resolve(runner=runner).runner.name == runner

    def test_v1_piecewise_resolves_to_a_wide_enough_region(self) -> None:
        resolution = self.resolve(runner="v1", cudagraph_mode="PIECEWISE")
        assert resolution.mixed_mode.name == "PIECEWISE"
        assert resolution.eager_region.covers(strategy_from_name("wide"))

    def test_a_narrower_region_is_refused_unless_unsafe(self) -> None:
        from runners import UnsafeRegionError

        required = self.resolve(runner="v1", cudagraph_mode="PIECEWISE").required_region
        narrower = [s for s in REGIONS if not strategy_from_name(s).covers(required)]
        for region in narrower:
            with pytest.raises(UnsafeRegionError, match=required.name):
                self.resolve(runner="v1", cudagraph_mode="PIECEWISE", eager_region=region)
            unsafe = self.resolve(
                runner="v1", cudagraph_mode="PIECEWISE", eager_region=region, unsafe_region=True
            )
            assert unsafe.unsafe_region and unsafe.eager_region.name == region

    # -- the graph backend ---------------------------------------------------------------------
    def test_graph_backend_replays_graph_eager_graph(self) -> None:
        platform = self.execution_platform()
        device = platform.device
        x = torch.zeros(4, device=device)
        mid = torch.zeros(4, device=device)

        @eager_break_during_capture
        def eager_step(y: torch.Tensor) -> None:
            mid.copy_(y + 1)

        def program() -> torch.Tensor:
            eager_step(x * 2)
            return mid * 3

        program()
        with BreakableCapture(platform.graph_backend()) as capture:
            out = program()
        assert capture.layout == "GEG"
        for step in range(3):
            values = torch.arange(4, dtype=torch.float32) + step
            x.copy_(values.to(device))
            capture.replay()
            assert torch.equal(out.cpu(), (values * 2 + 1) * 3)

    # -- the cross-strategy property suite ------------------------------------------------------
    def allowed_configurations(self) -> list[tuple[str, str, str]]:
        """Every (runner, mode, region) the resolution accepts on this platform, deduplicated
        by what it resolves to."""
        from runners import ResolutionError

        seen: dict[tuple[Any, ...], tuple[str, str, str]] = {}
        for runner, mode, region in itertools.product(RUNNERS, MODES, REGIONS):
            try:
                r = self.resolve(runner=runner, cudagraph_mode=mode, eager_region=region)
            except ResolutionError:
                continue
            key = (r.runner, r.decode_mode, r.mixed_mode, r.eager_region)
            seen.setdefault(key, (runner, mode, region))
        return list(seen.values())

    def test_allowed_configurations_include_the_default(self) -> None:
        default = self.resolve()
        keys = set()
        for runner, mode, region in self.allowed_configurations():
            r = self.resolve(runner=runner, cudagraph_mode=mode, eager_region=region)
            keys.add((r.runner, r.decode_mode, r.mixed_mode, r.eager_region))
        assert (
            default.runner,
            default.decode_mode,
            default.mixed_mode,
            default.eager_region,
        ) in keys

    @settings(
        max_examples=max(1, settings().max_examples // 12),
        # One property, many platforms: each subclass runs it with its own ``self``.
        suppress_health_check=[HealthCheck.differing_executors],
    )
    @given(config=tiny_configs(), prompts=prompt_batches(), seed=st.integers(0, 2**16))
    def test_every_allowed_configuration_generates_the_eager_output(
        self, config: Any, prompts: list[list[int]], seed: int
    ) -> None:
        from dsv4 import DeepseekV4ForCausalLM
        from dsv4.weights import randomize_
        from runners import CacheLayout, SamplingParams
        from runners.equivalence import Status, compare_to_eager, run_trace
        from runners.serving import EngineSpec

        torch.set_num_threads(1)
        platform = self.execution_platform()
        model = DeepseekV4ForCausalLM(config, device=platform.device)
        randomize_(model, seed, num_experts=config.n_routed_experts)
        spec = EngineSpec(
            platform=platform,
            capture_sizes=(1, 2, 4),
            max_num_tokens=16,
            layout=CacheLayout(num_blocks=40, block_size=4, max_rows=4, max_blocks_per_row=8),
        )
        params = SamplingParams(max_tokens=self.max_new_tokens)
        budget = 7  # prefill chunks up to 7 tokens: padded graphs and eager steps above size 4
        eager = run_trace(
            attrs.evolve(spec, cudagraph_mode="NONE"),
            model,
            prompts,
            params,
            max_num_batched_tokens=budget,
        )
        for runner, mode, region in self.allowed_configurations():
            verdict = compare_to_eager(
                attrs.evolve(spec, runner=runner, cudagraph_mode=mode, eager_region=region),
                model,
                prompts,
                params,
                eager=eager,
                atol=self.atol,
                max_num_batched_tokens=budget,
            )
            assert verdict.status is Status.EQUAL, (
                f"{runner} {mode} {region}: {verdict.status.value}: {verdict.detail}"
            )
