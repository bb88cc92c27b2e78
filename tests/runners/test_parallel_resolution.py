"""``resolve(..., tensor_parallel_size=N)`` against DESIGN §9: collectives are the platform's call.

Where the platform cannot capture collectives (the CPU tape with gloo, a plugin that never said),
each is an eager break and a FULL decode graph is downgraded to PIECEWISE at N > 1; where it can
(CUDA, ROCm), nothing changes but one reason. A simulated platform resolves as the real one and
runs with collectives outside its graphs. At N = 1 nothing differs from a single-process
resolution.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphs import STRATEGIES, EagerRegionStrategy, FullGraph, NarrowRegion, WideRegion
from graphs.backend import GraphBackend
from platforms import CpuPlatform, CudaPlatform, Platform, RocmPlatform, simulate
from platforms.cpu import tape_backend, tape_memory_pool
from runners import CUDAGraphMode, EngineSpec, ResolutionError, UnsafeRegionError, resolve
from runners.errors import ParallelSizeError
from runners.spec import resolve_spec

DSV4 = "DeepseekV4ForCausalLM"
NO_ENV: dict[str, str] = {}

CPU_COLLECTIVES = (
    "tensor parallel size 2: each collective is an eager break (platform cpu cannot capture gloo "
    "collectives into a graph: gloo communicates from its own host threads, outside the ops the "
    "tape records)"
)
CPU_DOWNGRADE = (
    "decode batches: FULL downgraded to PIECEWISE: platform cpu cannot capture collectives at "
    "tensor parallel size 2, and a full graph has no eager break"
)
CUDA_COLLECTIVES = (
    "tensor parallel size 2: collectives are captured inside the graphs (platform cuda can "
    "capture nccl collectives into a graph: NCCL kernels run on the capturing stream and are "
    "recorded into CUDA graphs like any other kernel)"
)
ROCM_COLLECTIVES = (
    "tensor parallel size 2: collectives are captured inside the graphs (platform rocm can "
    "capture nccl collectives into a graph: torch serves nccl with RCCL on ROCm, whose kernels "
    "run on the capturing stream and are recorded into HIP graphs like any other kernel)"
)
REGION_NARROW = (
    "eager region narrow required by mode PIECEWISE (widest of platform {name} full-graph, "
    "runner v2 full-graph, {modes}mode PIECEWISE narrow): PIECEWISE capture runs at least the "
    "attention core eagerly between graph pieces"
)


class ReadmeStylePlatform(Platform):
    """The README's plugin as written before parallelism: no collectives attribute at all."""

    name = "mydev"
    device_type = "cpu"
    eager_region_strategy = FullGraph()
    v2_excluded_architectures: frozenset[str] = frozenset()

    def is_available(self) -> bool:
        return True

    def create_memory_pool(self) -> Any:
        return tape_memory_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return tape_backend(pool)


class CapturingPlugin(ReadmeStylePlatform):
    """A plugin that claims its communicator records into its graphs."""

    name = "capdev"
    collectives_capturable = True
    distributed_backend = "xccl"


def test_cpu_at_two_ranks_downgrades_full_decode_with_a_reason() -> None:
    r = resolve(DSV4, CpuPlatform(), tensor_parallel_size=2, environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)
    assert r.eager_region == NarrowRegion() == r.required_region
    assert r.tensor_parallel_size == 2 and not r.collectives_in_graph
    assert r.reasons == (
        "platform cpu: given",
        f"runner v2: {DSV4} is in the ModelRunnerV2 default set",
        CPU_COLLECTIVES,
        "cudagraph mode FULL_AND_PIECEWISE: the default",
        CPU_DOWNGRADE,
        REGION_NARROW.format(name="cpu", modes=""),
    )


def test_cuda_at_two_ranks_keeps_full_decode_and_says_collectives_are_captured() -> None:
    r = resolve(DSV4, CudaPlatform(), tensor_parallel_size=2, environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
    assert r.collectives_in_graph
    assert r.reasons == (
        "platform cuda: given",
        f"runner v2: {DSV4} is in the ModelRunnerV2 default set",
        CUDA_COLLECTIVES,
        "cudagraph mode FULL_AND_PIECEWISE: the default",
        REGION_NARROW.format(name="cuda", modes="mode FULL full-graph, "),
    )


def test_rocm_at_two_ranks_captures_collectives_and_stays_v1_piecewise() -> None:
    r = resolve(DSV4, RocmPlatform(), tensor_parallel_size=2, environ=NO_ENV)
    alone = resolve(DSV4, RocmPlatform(), environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode, r.eager_region) == (
        alone.decode_mode,
        alone.mixed_mode,
        WideRegion(),
    )
    assert r.collectives_in_graph
    assert r.reasons == (*alone.reasons[:2], ROCM_COLLECTIVES, *alone.reasons[2:])
    # V1 already downgraded decode FULL; the collectives add no second downgrade
    assert sum("FULL downgraded" in x for x in r.reasons) == 1


def test_simulated_platforms_keep_the_real_collective_policy_but_break_on_the_tape() -> None:
    """The reasons quote the real platform's policy; the run on the tape breaks around each
    collective, so its decode FULL graphs are downgraded as on a platform that cannot capture
    them (the tape cannot record a gloo collective into a graph)."""
    real = resolve(DSV4, CudaPlatform(), tensor_parallel_size=2, environ=NO_ENV)
    sim = resolve(DSV4, simulate(CudaPlatform()), tensor_parallel_size=2, environ=NO_ENV)
    assert real.decode_mode is CUDAGraphMode.FULL and sim.decode_mode is CUDAGraphMode.PIECEWISE
    assert (sim.mixed_mode, sim.eager_region) == (real.mixed_mode, real.eager_region)
    assert real.collectives_in_graph and not sim.collectives_in_graph
    assert sim.reasons[0] == "platform cuda: simulated on the CPU"
    assert sim.reasons[2] == (
        "tensor parallel size 2: collectives are captured inside the graphs on the device "
        "(platform cuda can capture nccl collectives into a graph: NCCL kernels run on the "
        "capturing stream and are recorded into CUDA graphs like any other kernel); simulated on "
        "the CPU tape, the run breaks around each one instead"
    )
    assert sim.reasons[4] == (
        "decode batches: FULL downgraded to PIECEWISE: platform cuda breaks around collectives "
        "on the CPU tape at tensor parallel size 2, and a full graph has no eager break"
    )
    payload = sim.to_dict()
    assert (payload["distributed_backend"], payload["collectives_in_graph"]) == ("gloo", False)
    cpu = resolve(DSV4, simulate(CpuPlatform()), tensor_parallel_size=2, environ=NO_ENV)
    assert cpu.decode_mode is CUDAGraphMode.PIECEWISE and CPU_DOWNGRADE in cpu.reasons


def test_a_plugin_without_the_attribute_is_treated_as_unable_to_capture() -> None:
    r = resolve(DSV4, ReadmeStylePlatform(), tensor_parallel_size=4, environ=NO_ENV)
    assert r.decode_mode is CUDAGraphMode.PIECEWISE and not r.collectives_in_graph
    assert r.reasons[2] == (
        "tensor parallel size 4: each collective is an eager break (platform mydev cannot "
        "capture gloo collectives into a graph: it does not set collectives_capturable (the safe "
        "default))"
    )
    assert r.reasons[4] == (
        "decode batches: FULL downgraded to PIECEWISE: platform mydev cannot capture "
        "collectives at tensor parallel size 4, and a full graph has no eager break"
    )


def test_a_plugin_that_claims_capture_keeps_full_graphs() -> None:
    r = resolve(DSV4, CapturingPlugin(), tensor_parallel_size=8, environ=NO_ENV)
    assert r.decode_mode is CUDAGraphMode.FULL and r.collectives_in_graph
    assert r.reasons[2] == (
        "tensor parallel size 8: collectives are captured inside the graphs (platform capdev "
        "can capture xccl collectives into a graph: it sets collectives_capturable = True)"
    )
    assert r.to_dict()["distributed_backend"] == "xccl"


def test_an_explicit_full_mode_is_downgraded_and_an_explicit_region_is_not_mentioned() -> None:
    r = resolve(
        DSV4, "cpu", cudagraph_mode="FULL", eager_region="wide", tensor_parallel_size=2, environ={}
    )
    assert (r.decode_mode, r.mixed_mode, r.eager_region) == (
        CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.PIECEWISE,
        WideRegion(),
    )
    assert CPU_DOWNGRADE in r.reasons
    # the decode graph is PIECEWISE now, so the region applies to it: no "FULL graphs ignore it"
    assert not any("FULL graphs capture whole steps" in x for x in r.reasons)
    decode_only = resolve(
        DSV4, "cpu", cudagraph_mode="FULL_DECODE_ONLY", tensor_parallel_size=2, environ={}
    )
    assert (decode_only.decode_mode, decode_only.mixed_mode) == (
        CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.NONE,
    )


def test_an_unsafe_region_request_is_refused_as_at_one_rank() -> None:
    with pytest.raises(UnsafeRegionError, match="full-graph is narrower than the narrow region"):
        resolve(DSV4, "cpu", eager_region="full-graph", tensor_parallel_size=2, environ=NO_ENV)


@pytest.mark.parametrize("size", [0, -1, True, 2.0, "2", None])
def test_an_invalid_size_is_refused_in_one_line(size: object) -> None:
    with pytest.raises(ParallelSizeError) as info:
        resolve(DSV4, "cpu", tensor_parallel_size=size, environ=NO_ENV)  # type: ignore[arg-type]
    assert str(info.value) == f"tensor parallel size must be an integer >= 1, got {size!r}"
    assert isinstance(info.value, ResolutionError)


def test_size_one_is_the_single_process_resolution() -> None:
    for platform in (CpuPlatform(), CudaPlatform(), RocmPlatform(), simulate(RocmPlatform())):
        one = resolve(DSV4, platform, tensor_parallel_size=1, environ=NO_ENV)
        default = resolve(DSV4, platform, environ=NO_ENV)
        assert one == default and one.tensor_parallel_size == 1
        assert not any("collective" in x or "parallel" in x for x in one.reasons)


def test_to_dict_carries_the_parallel_keys() -> None:
    payload = resolve(DSV4, "cpu", tensor_parallel_size=2, environ=NO_ENV).to_dict()
    assert {k: payload[k] for k in ("tensor_parallel_size", "distributed_backend")} == {
        "tensor_parallel_size": 2,
        "distributed_backend": "gloo",
    }
    assert payload["collectives_in_graph"] is False
    cuda = resolve(DSV4, "cuda", environ=NO_ENV).to_dict()
    assert (cuda["tensor_parallel_size"], cuda["distributed_backend"]) == (1, "nccl")
    assert cuda["collectives_in_graph"] is True


def test_engine_spec_passes_the_size_to_the_resolution() -> None:
    spec = EngineSpec(platform="cpu", tensor_parallel_size=2)
    assert EngineSpec().tensor_parallel_size == 1
    r = resolve_spec(spec)
    assert r.tensor_parallel_size == 2 and r.decode_mode is CUDAGraphMode.PIECEWISE
    with pytest.raises(ParallelSizeError, match="got 0"):
        resolve_spec(attrs.evolve(spec, tensor_parallel_size=0))


PLATFORMS: list[Platform] = [
    CudaPlatform(),
    RocmPlatform(),
    CpuPlatform(),
    ReadmeStylePlatform(),
    CapturingPlugin(),
]


@given(
    platform=st.sampled_from(PLATFORMS),
    simulated=st.booleans(),
    runner=st.sampled_from([None, "v1", "v2"]),
    mode=st.sampled_from([None, *CUDAGraphMode]),
    region=st.sampled_from([None, *STRATEGIES]),
    size=st.integers(min_value=1, max_value=16),
)
def test_full_never_survives_collectives_that_must_break(
    platform: Platform,
    simulated: bool,
    runner: str | None,
    mode: CUDAGraphMode | None,
    region: EagerRegionStrategy | None,
    size: int,
) -> None:
    """Across platforms, simulation, runners, modes, regions and sizes: a decode FULL survives
    N > 1 only where the run captures collectives (the platform can, and it is not simulated on
    the tape); otherwise the parallel resolution is the
    single-process one; the runner is told to break around collectives exactly where the run is
    on the tape or the platform cannot capture them."""
    plat = simulate(platform) if simulated else platform
    args: dict[str, Any] = {"runner": runner, "cudagraph_mode": mode, "eager_region": region}
    try:
        alone = resolve(DSV4, plat, **args, environ=NO_ENV)
    except UnsafeRegionError:
        with pytest.raises(UnsafeRegionError):
            resolve(DSV4, plat, **args, tensor_parallel_size=size, environ=NO_ENV)
        return
    in_graph = platform.collectives_capturable and not simulated
    try:
        r = resolve(DSV4, plat, **args, tensor_parallel_size=size, environ=NO_ENV)
    except UnsafeRegionError:
        # only a downgraded FULL decode can raise the requirement: to PIECEWISE's narrow region
        assert size > 1 and not in_graph and alone.decode_mode is CUDAGraphMode.FULL
        assert region is not None and not region.covers(NarrowRegion()) and not alone.unsafe_region
        return
    assert r.collectives_in_graph == in_graph
    assert r.mixed_mode is not CUDAGraphMode.FULL
    if size == 1:
        assert r == alone
        return
    assert r.decode_mode is not CUDAGraphMode.FULL or in_graph
    assert sum(x.startswith(f"tensor parallel size {size}: ") for x in r.reasons) == 1
    assert platform.collectives_reason in r.reasons[2]
    if in_graph or alone.decode_mode is not CUDAGraphMode.FULL:
        assert (r.decode_mode, r.mixed_mode, r.eager_region) == (
            alone.decode_mode,
            alone.mixed_mode,
            alone.eager_region,
        )
        assert r.reasons == (*alone.reasons[:2], r.reasons[2], *alone.reasons[2:])
    else:
        assert r.decode_mode is CUDAGraphMode.PIECEWISE
        assert r.mixed_mode == alone.mixed_mode
        why = (
            "breaks around collectives on the CPU tape"
            if platform.collectives_capturable
            else "cannot capture collectives"
        )
        assert (
            f"decode batches: FULL downgraded to PIECEWISE: platform {platform.name} {why} at "
            f"tensor parallel size {size}, and a full graph has no eager break"
        ) in r.reasons
