"""``resolve`` against DESIGN §3: the seed's configuration behaviour, restated for this design."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphs import STRATEGIES, FullGraph, NarrowRegion, NoGraph, WideRegion
from platforms import (
    CpuPlatform,
    CudaPlatform,
    Platform,
    RocmPlatform,
    UnknownPlatformError,
    simulate,
)
from runners import (
    CUDAGraphMode,
    ModelRunnerV1,
    ModelRunnerV2,
    UnknownEagerRegionError,
    UnknownModeError,
    UnknownRunnerError,
    UnsafeRegionError,
    resolve,
)

DSV4 = "DeepseekV4ForCausalLM"
NO_ENV: dict[str, str] = {}


def test_cuda_defaults_deepseek_v4_to_v2_with_the_narrow_region() -> None:
    r = resolve(DSV4, CudaPlatform(), environ=NO_ENV)
    assert r.runner is ModelRunnerV2
    assert r.eager_region == NarrowRegion() == r.required_region
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
    assert not r.unsafe_region
    assert f"runner v2: {DSV4} is in the ModelRunnerV2 default set" in r.reasons


def test_rocm_defaults_deepseek_v4_to_v1_with_the_wide_region() -> None:
    r = resolve(DSV4, RocmPlatform(), environ=NO_ENV)
    assert r.runner is ModelRunnerV1
    assert r.eager_region == WideRegion()
    # V1 cannot run FULL graphs: the default FULL_AND_PIECEWISE decodes PIECEWISE instead.
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)
    assert any("rocm excludes DeepseekV4ForCausalLM" in reason for reason in r.reasons)
    assert any("decode batches: FULL downgraded to PIECEWISE" in x for x in r.reasons)


def test_an_explicit_runner_beats_the_default() -> None:
    assert resolve(DSV4, "rocm", runner="v2", environ=NO_ENV).runner is ModelRunnerV2
    assert resolve(DSV4, "rocm", runner="V2", environ=NO_ENV).eager_region == NarrowRegion()
    assert resolve(DSV4, "cuda", runner="v1", environ=NO_ENV).runner is ModelRunnerV1
    assert resolve(DSV4, "cuda", runner=ModelRunnerV1, environ=NO_ENV).runner is ModelRunnerV1
    assert resolve(DSV4, "cuda", runner="auto", environ=NO_ENV).runner is ModelRunnerV2


def test_dsv4_runner_environment_beats_the_default_but_not_the_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DSV4_RUNNER", "v2")
    r = resolve(DSV4, "rocm")
    assert r.runner is ModelRunnerV2
    assert "runner v2: chosen by DSV4_RUNNER" in r.reasons
    assert resolve(DSV4, "rocm", runner="v1").runner is ModelRunnerV1
    monkeypatch.setenv("DSV4_RUNNER", "auto")
    assert resolve(DSV4, "rocm").runner is ModelRunnerV1


def test_v1_with_piecewise_resolves_to_the_wide_region() -> None:
    r = resolve(DSV4, "cuda", runner="v1", cudagraph_mode="PIECEWISE", environ=NO_ENV)
    assert r.eager_region == WideRegion()
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)
    assert any(x.startswith("eager region wide required by runner v1") for x in r.reasons)


def test_v1_with_full_is_downgraded_with_a_reason() -> None:
    r = resolve(DSV4, "cuda", runner="v1", cudagraph_mode=CUDAGraphMode.FULL, environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)
    assert r.eager_region == WideRegion()
    downgrade = [x for x in r.reasons if "decode batches: FULL downgraded to PIECEWISE" in x]
    assert len(downgrade) == 1 and "runner v1 requires the wide region" in downgrade[0]


def test_full_serves_uniform_decode_only() -> None:
    r = resolve(DSV4, "cuda", cudagraph_mode="full", environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE)
    assert any("mixed batches: FULL downgraded to PIECEWISE" in x for x in r.reasons)


def test_full_decode_only_needs_no_eager_region_on_v2() -> None:
    r = resolve(DSV4, "cuda", cudagraph_mode="FULL_DECODE_ONLY", environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.FULL, CUDAGraphMode.NONE)
    assert r.eager_region == FullGraph()


def test_mode_none_captures_nothing() -> None:
    r = resolve(DSV4, "cuda", cudagraph_mode="NONE", environ=NO_ENV)
    assert (r.decode_mode, r.mixed_mode) == (CUDAGraphMode.NONE, CUDAGraphMode.NONE)
    assert r.eager_region == NoGraph()


def test_a_narrower_region_is_refused_naming_the_requirement_and_its_reason() -> None:
    with pytest.raises(UnsafeRegionError) as info:
        resolve(DSV4, "rocm", eager_region="narrow", environ=NO_ENV)
    message = str(info.value)
    assert "narrow is narrower than the wide region required by runner v1" in message
    assert "new tensors every step" in message and "unsafe" in message
    assert "\n" not in message
    with pytest.raises(UnsafeRegionError, match=r"full-graph.*narrow.*mode PIECEWISE"):
        resolve(DSV4, "cuda", eager_region=FullGraph(), environ=NO_ENV)


def test_the_unsafe_flag_admits_a_narrower_region_and_records_it() -> None:
    r = resolve(DSV4, "cuda", runner="v1", eager_region="narrow", unsafe_region=True, environ={})
    assert r.eager_region == NarrowRegion()
    assert r.required_region == WideRegion()
    assert r.unsafe_region
    assert any(x.startswith("UNSAFE eager region narrow") for x in r.reasons)


def test_a_wider_region_is_allowed_and_recorded() -> None:
    r = resolve(DSV4, "cuda", eager_region="wide", environ=NO_ENV)
    assert r.eager_region == WideRegion() and r.required_region == NarrowRegion()
    assert not r.unsafe_region
    assert "eager region wide: widened from narrow by request" in r.reasons
    assert resolve(DSV4, "rocm", eager_region="no-graph", environ=NO_ENV).eager_region == NoGraph()


def test_the_no_graph_region_keeps_attention_out_of_full_graphs_too() -> None:
    r = resolve(DSV4, "cuda", eager_region="no-graph", environ=NO_ENV)
    assert r.decode_mode is CUDAGraphMode.PIECEWISE and r.eager_region == NoGraph()
    assert any(
        "FULL downgraded to PIECEWISE: eager region no-graph was asked for" in reason
        for reason in r.reasons
    )


def test_an_explicit_region_says_full_decode_graphs_ignore_it() -> None:
    r = resolve(DSV4, "cuda", eager_region="wide", environ=NO_ENV)
    assert r.decode_mode is CUDAGraphMode.FULL
    assert (
        "decode batches: FULL graphs capture whole steps; eager region wide applies to "
        "PIECEWISE graphs" in r.reasons
    )


def test_switching_platform_objects_needs_no_cache_clearing() -> None:
    """The same process resolves CUDA, ROCm, CUDA again: each answer is the platform's own."""
    runners = [
        resolve(DSV4, p, environ=NO_ENV).runner
        for p in (CudaPlatform(), RocmPlatform(), CudaPlatform(), simulate(RocmPlatform()))
    ]
    assert runners == [ModelRunnerV2, ModelRunnerV1, ModelRunnerV2, ModelRunnerV1]


def test_an_architecture_outside_the_default_set_defaults_to_v1() -> None:
    r = resolve("LlamaForCausalLM", "cuda", environ=NO_ENV)
    assert r.runner is ModelRunnerV1
    assert "runner v1: LlamaForCausalLM is not in the ModelRunnerV2 default set" in r.reasons


def test_simulated_platforms_resolve_like_their_device_and_say_so() -> None:
    r = resolve(DSV4, simulate(RocmPlatform()), environ=NO_ENV)
    assert r.runner is ModelRunnerV1 and r.eager_region == WideRegion()
    assert r.reasons[0] == "platform rocm: simulated on the CPU"
    assert r.to_dict()["simulated"] is True


def test_to_dict_carries_the_cli_keys() -> None:
    payload = resolve(DSV4, "rocm", environ=NO_ENV).to_dict()
    assert payload["platform"] == "rocm"
    assert payload["runner"] == "v1"
    assert payload["cudagraph_mode"] == {"decode": "PIECEWISE", "mixed": "PIECEWISE"}
    assert payload["eager_region"] == "wide"
    assert payload["reasons"] and all(isinstance(x, str) for x in payload["reasons"])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"platform": "tpu"}, UnknownPlatformError, r"unknown platform 'tpu'.*cpu, cuda, rocm"),
        ({"runner": "v3"}, UnknownRunnerError, r"unknown runner 'v3'.*auto, v1, v2"),
        ({"cudagraph_mode": "HALF"}, UnknownModeError, r"'HALF'.*FULL_AND_PIECEWISE"),
        ({"eager_region": "medium"}, UnknownEagerRegionError, r"'medium'.*narrow, wide"),
    ],
)
def test_bad_names_give_one_clear_error_each(
    kwargs: dict[str, str], error: type[Exception], pattern: str
) -> None:
    args = {"platform": "cuda", **kwargs}
    with pytest.raises(error, match=pattern) as info:
        resolve(DSV4, environ=NO_ENV, **args)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_bad_dsv4_runner_value_names_the_variable() -> None:
    with pytest.raises(UnknownRunnerError, match="DSV4_RUNNER value 'v9'"):
        resolve(DSV4, "cuda", environ={"DSV4_RUNNER": "v9"})


PLATFORMS: list[Platform] = [CudaPlatform(), RocmPlatform(), CpuPlatform()]


@given(
    platform=st.sampled_from(PLATFORMS),
    architecture=st.sampled_from([DSV4, "LlamaForCausalLM"]),
    runner=st.sampled_from([None, "v1", "v2"]),
    mode=st.sampled_from([None, *CUDAGraphMode]),
    region=st.sampled_from([None, *STRATEGIES]),
    unsafe=st.booleans(),
)
def test_resolution_invariants(
    platform: Platform,
    architecture: str,
    runner: str | None,
    mode: CUDAGraphMode | None,
    region: NarrowRegion | None,
    unsafe: bool,
) -> None:
    """Every resolution obeys DESIGN §3; a refusal happens exactly when the region is too narrow."""
    try:
        r = resolve(architecture, platform, runner, mode, region, unsafe, environ=NO_ENV)
    except UnsafeRegionError:
        safe = resolve(architecture, platform, runner, mode, None, environ=NO_ENV)
        assert region is not None and not region.covers(safe.required_region) and not unsafe
        return
    base = platform.eager_region_strategy.join(r.runner.eager_region_strategy)
    assert r.mixed_mode is not CUDAGraphMode.FULL
    assert r.decode_mode is not CUDAGraphMode.FULL or base == FullGraph()
    if CUDAGraphMode.PIECEWISE in (r.decode_mode, r.mixed_mode):
        assert r.required_region == base.join(NarrowRegion())
    assert r.eager_region == (region if region is not None else r.required_region)
    assert r.unsafe_region == (not r.eager_region.covers(r.required_region))
    assert len(r.reasons) >= 4 and all("\n" not in x for x in r.reasons)
    if runner is not None:
        assert r.runner.name == runner
    elif architecture == DSV4:
        expected = ModelRunnerV1 if platform.name == "rocm" else ModelRunnerV2
        assert r.runner is expected
    else:
        assert r.runner is ModelRunnerV1
