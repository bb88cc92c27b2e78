"""``PlatformConformanceTests``: the one base class a platform author subclasses.

Usage (in the author's test suite; no ``conftest.py`` of ours is needed)::

    from runners.testing import PlatformConformanceTests

    class TestMyPlatform(PlatformConformanceTests):
        required_region = "wide"                 # capability flags: what the policy must say
        excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

        def make_platform(self) -> Platform:
            return MyPlatform()

The class checks the platform's policy against the flags (identity, declared requirements, the
resolution it yields for DeepSeek-V4 alone and at ``tensor_parallel_size`` ranks, where its
collective policy decides whether FULL graphs survive, its simulation, its graph backend) and
then proves every
(runner, graph mode, eager region) the resolution allows equal to eager, in two passes
(``passes``): a deterministic pass over every allowed configuration on a fixed tiny model and
fixed prompts, so a wrong claim fails within seconds, then a random search (hypothesis, under
the kit's own ``kit_settings``) over tiny models, batches and weights.

Both compare generated tokens and logits (within ``atol``) with an eager run, and every failure
names the platform, the configuration, the prompt and the first differing token or the
exception (``checks``). They run on the platform's device when it is available (and
``run_on_device``), simulated on the CPU tape otherwise — and then say so with a
``SimulatedRunWarning`` that quotes ``checks.SIMULATION_SCOPE``: what a simulated run can and
cannot refute.

This module is test-time code: unlike the rest of ``runners`` it needs hypothesis and pytest.
"""

from __future__ import annotations

import abc
import itertools
import warnings
from typing import Any, ClassVar

import pytest
import torch

from dsv4.config import ARCHITECTURE as DSV4
from graphs import BreakableCapture, NarrowRegion, eager_break_during_capture, strategy_from_name
from platforms.base import Platform
from platforms.simulate import simulate
from runners import CUDAGraphMode, Resolution, ResolutionError, UnsafeRegionError, resolve
from runners.distributed import check_local_devices
from runners.errors import DeviceCountError
from runners.measure.matrix import MODE_NAMES, REGION_NAMES
from runners.resolution import RUNNERS
from runners.testing.checks import (
    SIMULATION_SCOPE,
    Configuration,
    SimulatedRunWarning,
    expect,
    platform_label,
    resolved,
)
from runners.testing.parallel import parallel_pass
from runners.testing.passes import deterministic_pass, random_search

__all__ = ["PlatformConformanceTests"]


def _simulated_instead(platform: Platform, why: str) -> Platform:
    """``platform``'s policy simulated on the CPU tape, with a ``SimulatedRunWarning`` (pointing
    at the kit's caller) saying ``why`` and what a simulated run proves."""
    simulated = simulate(platform)
    warnings.warn(
        SimulatedRunWarning(f"{platform_label(simulated)}: {why}. {SIMULATION_SCOPE}"),
        stacklevel=3,
    )
    return simulated


class PlatformConformanceTests(abc.ABC):
    """Subclass with a ``Test...`` name, implement ``make_platform`` and set the flags."""

    # -- capability flags ------------------------------------------------------------------------
    required_region: ClassVar[str] = "full-graph"
    """Name of the eager region the platform's policy requires (``eager_region_strategy``)."""
    excludes_from_v2: ClassVar[frozenset[str]] = frozenset()
    """Architectures the platform excludes from the ModelRunnerV2 default."""
    captures_collectives: ClassVar[bool] = False
    """Whether the platform's collectives are captured into its graphs
    (``collectives_capturable``; unset there, it is ``False``)."""
    tensor_parallel_size: ClassVar[int] = 2
    """The parallel size (above 1) the kit resolves at to check the collective policy."""
    run_on_device: ClassVar[bool] = True
    """Run the equivalence passes on the real device when available (else always simulated)."""
    atol: ClassVar[float | None] = None
    """Largest logit difference from eager that still counts as equal; ``None`` for
    ``runners.measure.equivalence.equality_tolerance`` of the device and dtype (5e-5 in float32
    on the CPU, 1e-3 on a GPU)."""
    max_new_tokens: ClassVar[int] = 4

    @abc.abstractmethod
    def make_platform(self) -> Platform:
        """A fresh instance of the platform under test."""

    # -- helpers ---------------------------------------------------------------------------------
    def execution_platform(self) -> Platform:
        """Where the equivalence passes run: the device if available and allowed, else the
        policy simulated on the CPU tape (with a ``SimulatedRunWarning`` saying what that
        proves)."""
        platform = self.make_platform()
        if self.run_on_device and platform.is_available():
            return platform
        why = platform.unavailable_reason() if self.run_on_device else "run_on_device is False"
        return _simulated_instead(platform, why)

    def parallel_platform(self, size: int) -> Platform:
        """Where the parallel pass of ``size`` local ranks runs: ``execution_platform`` where it
        has a device for every rank (or its ranks share one), else the policy simulated on the
        CPU tape, with a ``SimulatedRunWarning`` naming the devices missing (a rank without a
        device of its own fails at its first allocation: 'invalid device ordinal')."""
        platform = self.execution_platform()
        try:
            check_local_devices(platform, size)
        except DeviceCountError as short:
            return _simulated_instead(platform, str(short))
        return platform

    def resolve(self, **overrides: Any) -> Resolution:
        """``resolve`` of DeepSeek-V4 on a fresh platform (``tensor_parallel_size`` among the
        overrides; 1 unless given)."""
        return resolve(DSV4, self.make_platform(), environ={}, **overrides)

    # -- identity and declared policy ----------------------------------------------------------
    def test_identity(self) -> None:
        platform = self.make_platform()
        expect(isinstance(platform, Platform), f"make_platform() returned {platform!r}")
        name = platform.name
        expect(bool(name) and name == name.strip().lower(), f"{name!r}: not a lower-case name")
        expect(
            isinstance(platform.device_type, str) and bool(platform.device_type),
            f"platform {name}: device_type {platform.device_type!r} is not a torch device type",
        )
        available = platform.is_available()
        expect(
            isinstance(available, bool), f"platform {name}: is_available() returned {available!r}"
        )
        expect(
            available or bool(platform.unavailable_reason().strip()),
            f"platform {name}: unavailable, and unavailable_reason() is empty",
        )
        other = self.make_platform()
        expect(
            platform == other and hash(platform) == hash(other),
            f"platform {name}: two make_platform() results {platform!r} and {other!r} must "
            "compare equal with equal hashes",
        )

    def test_policy_matches_the_declared_capabilities(self) -> None:
        platform = self.make_platform()
        claimed = platform.eager_region_strategy.name
        expect(
            claimed == strategy_from_name(self.required_region).name,
            f"platform {platform.name}: the test class says required_region = "
            f"{self.required_region!r}, the platform's eager_region_strategy is {claimed!r}",
        )
        expect(
            bool(platform.eager_region_reason.strip()),
            f"platform {platform.name}: eager_region_reason is empty",
        )
        excluded = platform.v2_excluded_architectures
        expect(
            excluded == self.excludes_from_v2,
            f"platform {platform.name}: the test class says excludes_from_v2 = "
            f"{sorted(self.excludes_from_v2)}, the platform's v2_excluded_architectures is "
            f"{sorted(excluded)}",
        )
        for architecture in sorted(excluded):
            expect(
                bool(platform.v2_exclusion_reason(architecture).strip()),
                f"platform {platform.name}: v2_exclusion_reason({architecture!r}) is empty",
            )
        captures = platform.collectives_capturable
        expect(
            captures is self.captures_collectives,
            f"platform {platform.name}: the test class says captures_collectives = "
            f"{self.captures_collectives}, the platform's collectives_capturable is {captures!r}",
        )
        backend = platform.distributed_backend
        expect(
            isinstance(backend, str) and bool(backend.strip()),
            f"platform {platform.name}: distributed_backend {backend!r} is not a backend name",
        )
        expect(
            bool(platform.collectives_reason.strip()),
            f"platform {platform.name}: collectives_reason is empty",
        )

    def test_simulation_keeps_the_policy_and_runs_on_the_cpu(self) -> None:
        platform = self.make_platform()
        simulated = simulate(platform)
        policy = (
            "name",
            "eager_region_strategy",
            "v2_excluded_architectures",
            "collectives_capturable",
            "collectives_reason",
        )
        for field in policy:
            got, expected = getattr(simulated, field), getattr(platform, field)
            expect(
                got == expected,
                f"simulate(platform {platform.name}).{field} is {got!r}, the platform's is "
                f"{expected!r}",
            )
        expect(
            simulated.simulated and simulated.is_available() and simulated.device_type == "cpu",
            f"simulate(platform {platform.name}) is not an available CPU platform",
        )

    # -- resolution ------------------------------------------------------------------------------
    def test_default_resolution_follows_the_design(self) -> None:
        platform = self.make_platform()
        r = self.resolve()
        excluded = DSV4 in self.excludes_from_v2
        runner = RUNNERS["v1" if excluded else "v2"]
        base = platform.eager_region_strategy.join(r.runner.eager_region_strategy)
        expected = {
            "runner": (r.runner.name, runner.name),
            "eager region": (r.eager_region.name, base.join(NarrowRegion()).name),
            "decode mode": (
                r.decode_mode.name,
                "FULL" if base.name == "full-graph" else "PIECEWISE",
            ),
            "mixed mode": (r.mixed_mode.name, "PIECEWISE"),
        }
        for what, (got, want) in expected.items():
            expect(
                got == want,
                f"platform {platform.name}: the default resolution of {DSV4} has {what} {got}, "
                f"expected {want}; reasons: {list(r.reasons)}",
            )

    def test_parallel_resolution_follows_the_collective_policy(self) -> None:
        """At ``tensor_parallel_size`` ranks the default resolution is the single-process one
        plus a reason quoting ``collectives_reason``, except that a decode FULL is downgraded
        (with a reason naming the size) when the platform cannot capture collectives. Simulated,
        the resolution is the same, and the run breaks around collectives."""
        size = self.tensor_parallel_size
        expect(size > 1, f"tensor_parallel_size = {size}: the kit checks parallel runs (> 1)")
        platform = self.make_platform()
        alone, parallel = self.resolve(), self.resolve(tensor_parallel_size=size)
        keeps_full = alone.decode_mode is not CUDAGraphMode.FULL or self.captures_collectives
        decode = alone.decode_mode if keeps_full else CUDAGraphMode.PIECEWISE
        label = f"platform {platform.name} at tensor parallel size {size}"
        expect(
            (parallel.decode_mode, parallel.mixed_mode, parallel.eager_region)
            == (decode, alone.mixed_mode, alone.eager_region),
            f"{label}: resolved to {resolved(parallel)}, expected decode {decode.name}, mixed "
            f"{alone.mixed_mode.name}, region {alone.eager_region.name} (alone: "
            f"{resolved(alone)}); reasons: {list(parallel.reasons)}",
        )
        sized = [x for x in parallel.reasons if f"tensor parallel size {size}" in x]
        rest = [x for x in parallel.reasons if x not in sized]
        downgrade = "decode batches: FULL downgraded to PIECEWISE"
        as_expected = (
            (rest == list(alone.reasons) and len(sized) == 1)
            if keeps_full
            else (len(sized) == 2 and sized[1].startswith(downgrade))
        )
        expect(
            as_expected,
            f"{label}: reasons {list(parallel.reasons)} are not the single-process reasons "
            f"{list(alone.reasons)} plus the collectives' own"
            + ("" if keeps_full else " and the decode downgrade"),
        )
        expect(
            any(platform.collectives_reason in x for x in sized),
            f"{label}: no reason quotes collectives_reason {platform.collectives_reason!r}: "
            f"{sized}",
        )
        expect(
            parallel.collectives_in_graph is self.captures_collectives,
            f"{label}: collectives_in_graph is {parallel.collectives_in_graph}",
        )
        # On the tape every collective breaks, so a simulated run keeps no decode FULL
        simulated = resolve(DSV4, simulate(platform), environ={}, tensor_parallel_size=size)
        breaking = decode if decode is not CUDAGraphMode.FULL else CUDAGraphMode.PIECEWISE
        expect(
            (simulated.decode_mode, simulated.mixed_mode, simulated.eager_region)
            == (breaking, parallel.mixed_mode, parallel.eager_region)
            and not simulated.collectives_in_graph,
            f"simulate(platform {platform.name}) at tensor parallel size {size} resolved to "
            f"{resolved(simulated)} with collectives_in_graph {simulated.collectives_in_graph}; "
            f"expected decode {breaking.name}, mixed {parallel.mixed_mode.name}, region "
            f"{parallel.eager_region.name} with the collectives breaking on the tape",
        )

    @pytest.mark.parametrize("runner", sorted(RUNNERS))
    def test_an_explicit_runner_wins(self, runner: str) -> None:
        got = self.resolve(runner=runner).runner.name
        expect(got == runner, f"runner={runner!r} resolved to runner {got}")

    def test_v1_piecewise_resolves_to_a_wide_enough_region(self) -> None:
        r = self.resolve(runner="v1", cudagraph_mode="PIECEWISE")
        expect(
            r.mixed_mode is CUDAGraphMode.PIECEWISE
            and r.eager_region.covers(strategy_from_name("wide")),
            f"runner v1, graph mode PIECEWISE resolved to mixed {r.mixed_mode.name}, "
            f"region {r.eager_region.name} (expected PIECEWISE, at least wide)",
        )

    def test_a_narrower_region_is_refused_unless_unsafe(self) -> None:
        required = self.resolve(runner="v1", cudagraph_mode="PIECEWISE").required_region
        request: dict[str, Any] = {"runner": "v1", "cudagraph_mode": "PIECEWISE"}
        for region in [s for s in REGION_NAMES if not strategy_from_name(s).covers(required)]:
            try:
                self.resolve(**request, eager_region=region)
            except UnsafeRegionError as exc:
                expect(required.name in str(exc), f"the refusal does not name {required}: {exc}")
            else:
                raise AssertionError(
                    f"runner v1, graph mode PIECEWISE, region {region} was accepted although "
                    f"{required.name} is required"
                )
            unsafe = self.resolve(**request, eager_region=region, unsafe_region=True)
            expect(
                unsafe.unsafe_region and unsafe.eager_region.name == region,
                f"unsafe_region=True with region {region} resolved to {unsafe.eager_region}",
            )

    # -- the graph backend ---------------------------------------------------------------------
    def test_graph_backend_replays_graph_eager_graph(self) -> None:
        platform = self.execution_platform()
        x = torch.zeros(4, device=platform.device)
        mid = torch.zeros(4, device=platform.device)

        @eager_break_during_capture
        def eager_step(y: torch.Tensor) -> None:
            mid.copy_(y + 1)

        def program() -> torch.Tensor:
            eager_step(x * 2)
            return mid * 3

        program()
        with BreakableCapture(platform.graph_backend()) as capture:
            out = program()
        label = f"{platform_label(platform)}: graph backend"
        expect(capture.layout == "GEG", f"{label}: layout {capture.layout}, expected GEG")
        for step in range(3):
            values = torch.arange(4, dtype=torch.float32) + step
            x.copy_(values.to(platform.device))
            capture.replay()
            want = (values * 2 + 1) * 3
            got = out.cpu()
            expect(torch.equal(got, want), f"{label}: replay {step} gave {got}, expected {want}")

    # -- equivalence to eager -------------------------------------------------------------------
    def allowed_configurations(
        self, tensor_parallel_size: int = 1, platform: Platform | None = None
    ) -> list[Configuration]:
        """Every (runner, mode, region) the resolution accepts on this platform (or on
        ``platform``: the one a pass executes on, simulated or not) at ``tensor_parallel_size``
        ranks, one per distinct resolution (the first spelling of each)."""
        seen: dict[tuple[Any, ...], Configuration] = {}
        target = self.make_platform() if platform is None else platform
        for runner, mode, region in itertools.product(sorted(RUNNERS), MODE_NAMES, REGION_NAMES):
            try:
                r = resolve(
                    DSV4,
                    target,
                    environ={},
                    runner=runner,
                    cudagraph_mode=mode,
                    eager_region=region,
                    tensor_parallel_size=tensor_parallel_size,
                )
            except ResolutionError:
                continue
            configuration = Configuration(
                runner=runner, mode=mode, region=region, resolved=resolved(r)
            )
            seen.setdefault((r.runner, r.decode_mode, r.mixed_mode, r.eager_region), configuration)
        return list(seen.values())

    def test_allowed_configurations_include_the_default(self) -> None:
        default = self.resolve()
        allowed = self.allowed_configurations()
        expect(
            any(
                (c.runner, c.resolved) == (default.runner.name, resolved(default)) for c in allowed
            ),
            f"the default (runner {default.runner.name}, {resolved(default)}) is not among the "
            f"allowed configurations: {[str(c) for c in allowed]}",
        )

    def test_every_allowed_configuration_generates_the_eager_output(self) -> None:
        """The deterministic pass, then (only if it passed) the random search (``passes``)."""
        platform = self.execution_platform()
        configurations = self.allowed_configurations()
        for run_pass in (deterministic_pass, random_search):
            run_pass(platform, configurations, atol=self.atol, max_new_tokens=self.max_new_tokens)

    def test_parallel_runs_generate_the_single_rank_output(self) -> None:
        """Every configuration allowed at ``tensor_parallel_size`` ranks, run on that many local
        ranks (one parallel run for them all), generates the eager tokens of one rank."""
        size = self.tensor_parallel_size
        platform = self.parallel_platform(size)
        parallel_pass(
            platform,
            self.allowed_configurations(tensor_parallel_size=size, platform=platform),
            size=size,
            atol=self.atol,
            max_new_tokens=self.max_new_tokens,
        )
