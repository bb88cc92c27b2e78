"""The conformance kit's own promises: its settings, its warnings and the words of its failures.

Kit subclasses here have no ``Test`` prefix, so pytest does not collect them as suites; each test
calls one inherited check and reads the ``AssertionError`` it raises.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase

from graphs import WideRegion
from graphs.backend import GraphBackend
from graphs.strategies import EagerRegionStrategy
from platforms import CpuPlatform, CudaPlatform, Platform
from platforms.cpu import tape_backend
from runners.measure.equivalence import run_trace
from runners.testing import (
    SIMULATION_SCOPE,
    PlatformConformanceTests,
    SimulatedRunWarning,
    kit_settings,
)
from runners.testing.checks import STEP_BUDGET, Workload, engine_spec
from runners.testing.passes import random_search
from runners.testing.strategies import FIXED_PROMPTS, fixed_config


class CaptureFailsPlatform(CpuPlatform):
    """Requires the wide region; its graph backend refuses to record anything."""

    @property
    def name(self) -> str:
        return "nocapture"

    @property
    def eager_region_strategy(self) -> EagerRegionStrategy:
        return WideRegion()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        backend = tape_backend(pool)

        def refuse() -> None:
            raise RuntimeError("this device cannot record graphs")

        backend.begin_segment = refuse  # type: ignore[method-assign]
        return backend


class CpuClaimingWide(PlatformConformanceTests):
    required_region = "wide"

    def make_platform(self) -> Platform:
        return CpuPlatform()


class CpuClaimingExclusions(PlatformConformanceTests):
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

    def make_platform(self) -> Platform:
        return CpuPlatform()


class CpuClaimingCapturedCollectives(PlatformConformanceTests):
    captures_collectives = True

    def make_platform(self) -> Platform:
        return CpuPlatform()


class CudaClaimingBrokenCollectives(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CudaPlatform()


class CpuAtOneRank(PlatformConformanceTests):
    tensor_parallel_size = 1

    def make_platform(self) -> Platform:
        return CpuPlatform()


class CaptureFails(PlatformConformanceTests):
    required_region = "wide"

    def make_platform(self) -> Platform:
        return CaptureFailsPlatform()


class CudaHere(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CudaPlatform()


class OneDevice(CpuPlatform):
    """A platform with one device of its own here, as on a machine with one GPU."""

    def device_count(self) -> int | None:
        return 1


class OneDeviceHere(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return OneDevice()


def test_a_parallel_pass_with_fewer_devices_than_ranks_is_simulated_and_says_why() -> None:
    """Seen on a one-GPU machine: the second rank failed at its first allocation ('invalid
    device ordinal'). Short of a device per rank, the kit simulates the parallel pass."""
    assert not OneDeviceHere().parallel_platform(1).simulated
    with pytest.warns(SimulatedRunWarning) as record:
        platform = OneDeviceHere().parallel_platform(2)
    assert platform.simulated
    message = str(record[0].message)
    assert "needs 2 cpu devices" in message and "has 1 on this machine" in message
    assert SIMULATION_SCOPE in message


@pytest.mark.parametrize(
    ("profile", "examples", "derandomize", "shrinks"),
    [("dev", 5, False, False), ("ci", 8, True, False), ("thorough", 200, False, True)],
)
def test_the_kit_settings_follow_the_profile_without_a_deadline(
    profile: str, examples: int, derandomize: bool, shrinks: bool
) -> None:
    settings = kit_settings({"HYPOTHESIS_PROFILE": profile})
    assert settings.deadline is None
    assert {HealthCheck.too_slow, HealthCheck.data_too_large} <= set(settings.suppress_health_check)
    assert (settings.max_examples, settings.derandomize) == (examples, derandomize)
    assert (Phase.shrink in settings.phases) == shrinks


def test_an_unknown_or_missing_profile_is_dev() -> None:
    dev = kit_settings({"HYPOTHESIS_PROFILE": "dev"})
    for environ in ({}, {"HYPOTHESIS_PROFILE": "nightly"}):
        assert kit_settings(environ).max_examples == dev.max_examples


def test_a_wrong_required_region_names_both_values() -> None:
    with pytest.raises(
        AssertionError,
        match=r"platform cpu: the test class says required_region = 'wide', "
        r"the platform's eager_region_strategy is 'full-graph'",
    ):
        CpuClaimingWide().test_policy_matches_the_declared_capabilities()


def test_wrong_exclusions_name_both_values() -> None:
    with pytest.raises(
        AssertionError,
        match=r"excludes_from_v2 = \['DeepseekV4ForCausalLM'\], "
        r"the platform's v2_excluded_architectures is \[\]",
    ):
        CpuClaimingExclusions().test_policy_matches_the_declared_capabilities()
    with pytest.raises(AssertionError, match=r"default resolution .* runner v2, expected v1"):
        CpuClaimingExclusions().test_default_resolution_follows_the_design()


def test_a_wrong_collectives_claim_names_both_values_and_the_resolution() -> None:
    with pytest.raises(
        AssertionError,
        match=r"^platform cpu: the test class says captures_collectives = True, the platform's "
        r"collectives_capturable is False$",
    ):
        CpuClaimingCapturedCollectives().test_policy_matches_the_declared_capabilities()
    with pytest.raises(
        AssertionError,
        match=r"^platform cpu at tensor parallel size 2: resolved to decode PIECEWISE, mixed "
        r"PIECEWISE, region narrow, expected decode FULL, mixed PIECEWISE, region narrow ",
    ):
        CpuClaimingCapturedCollectives().test_parallel_resolution_follows_the_collective_policy()
    with pytest.raises(
        AssertionError,
        match=r"^platform cuda at tensor parallel size 2: resolved to decode FULL, mixed "
        r"PIECEWISE, region narrow, expected decode PIECEWISE, ",
    ):
        CudaClaimingBrokenCollectives().test_parallel_resolution_follows_the_collective_policy()


def test_the_parallel_check_needs_more_than_one_rank() -> None:
    with pytest.raises(
        AssertionError, match=r"^tensor_parallel_size = 1: the kit checks parallel runs \(> 1\)$"
    ):
        CpuAtOneRank().test_parallel_resolution_follows_the_collective_policy()


def test_allowed_configurations_take_the_parallel_size() -> None:
    """At two ranks on the CPU no configuration resolves to a FULL decode graph; at one, some
    do. (The multi-process equivalence runs use this parameter.)"""
    kit = CpuAtOneRank()
    alone, parallel = kit.allowed_configurations(), kit.allowed_configurations(2)
    assert any(c.resolved.startswith("decode FULL") for c in alone)
    assert parallel and not any(c.resolved.startswith("decode FULL") for c in parallel)


def test_a_configuration_that_raises_is_named_with_the_exception() -> None:
    kit = CaptureFails()
    with pytest.raises(AssertionError) as failure:
        kit.test_every_allowed_configuration_generates_the_eager_output()
    message = str(failure.value)
    graphs = [c for c in kit.allowed_configurations() if c.mode != "NONE"]
    assert message.startswith(
        f"platform nocapture (on its cpu device): {len(graphs)} of "
        f"{len(kit.allowed_configurations())} allowed configurations differ from eager"
    )
    for configuration in graphs:
        assert (
            f"  {configuration}: raised RuntimeError: this device cannot record graphs" in message
        )
    assert isinstance(failure.value.__cause__, RuntimeError)  # its traceback is shown too


def test_the_random_search_names_the_model_and_the_configuration() -> None:
    graphs = [c for c in CaptureFails().allowed_configurations() if c.mode != "NONE"]
    with pytest.raises(
        AssertionError,
        match=r"^platform nocapture \(on its cpu device\): runner v[12], graph mode \w+, "
        r"region [\w-]+ \(resolved: [^)]*\): random model \(layers \[.*\], \d+ indexer heads, "
        r"weights seed \d+, indexer weights '[\w-]+'\), "
        r"prompts \[\[[\d, \[\]]+\]\]: raised RuntimeError: this device cannot record graphs\n",
    ):
        random_search(CaptureFailsPlatform(), graphs, atol=None, max_new_tokens=2)


@pytest.mark.skipif(CudaPlatform().is_available(), reason="needs a machine without CUDA")
def test_a_simulated_run_says_what_it_can_and_cannot_refute() -> None:
    with pytest.warns(SimulatedRunWarning) as record:
        platform = CudaHere().execution_platform()
    assert platform.simulated and platform.name == "cuda"
    message = str(record[0].message)
    assert message.startswith("platform cuda (simulated on the CPU tape): ")
    assert SIMULATION_SCOPE in message and "cannot refute" in message


def test_the_fast_single_process_pass_runs_before_the_parallel_one() -> None:
    """pytest runs a class's tests in the order they are defined: the deterministic pass (seconds,
    one process) comes before the parallel run (ranks to start), so a wrong claim fails first."""
    tests = [name for name in vars(PlatformConformanceTests) if name.startswith("test_")]
    single = tests.index("test_every_allowed_configuration_generates_the_eager_output")
    assert single < tests.index("test_parallel_runs_generate_the_single_rank_output")


def test_the_deterministic_pass_finds_a_cached_prefix_and_keeps_the_uncached_tokens() -> None:
    """The fourth fixed prompt starts with the first's 8 tokens (the fixed model's prefix
    boundary at the kit's 4-token blocks): the eager reference every configuration is compared
    with finds them cached, and generates what an engine without the cache generates."""
    platform = CpuPlatform()
    workload = Workload.build(platform, fixed_config(), FIXED_PROMPTS, seed=0, max_new_tokens=4)
    assert workload.eager.prefix_cache_hit_tokens == 8
    spec = attrs.evolve(engine_spec(platform), cudagraph_mode="NONE", enable_prefix_caching=False)
    uncached = run_trace(
        spec, workload.model, workload.prompts, workload.params, max_num_batched_tokens=STEP_BUDGET
    )
    assert uncached.prefix_cache_hit_tokens == 0
    assert uncached.outputs == workload.eager.outputs
