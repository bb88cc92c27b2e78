"""The built-in platforms, the ``Platform`` ABC, ``simulate`` and the registry's lookups."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphs import FullGraph, WideRegion
from graphs.backend import GraphBackend
from platforms import (
    CpuPlatform,
    CudaPlatform,
    Platform,
    PlatformRegistrationError,
    PlatformRegistry,
    PlatformUnavailableError,
    RocmPlatform,
    UnknownPlatformError,
    current_platform,
    get_platform,
    register_platform,
    simulate,
    unregister_platform,
)
from platforms.base import REQUIRED_ATTRIBUTES


class OfflinePlatform(Platform):
    """A platform whose device is never present; requires the wide region."""

    name = "offline"
    device_type = "cuda"
    eager_region_strategy = WideRegion()
    v2_excluded_architectures = frozenset({"DeepseekV4ForCausalLM"})

    def is_available(self) -> bool:
        return False

    def unavailable_reason(self) -> str:
        return "the offline accelerator is unplugged"

    def create_memory_pool(self) -> Any:
        raise AssertionError("never called on an unavailable platform")

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        raise AssertionError("never called on an unavailable platform")


def test_builtin_policies() -> None:
    cuda, rocm, cpu = CudaPlatform(), RocmPlatform(), CpuPlatform()
    assert (cuda.name, rocm.name, cpu.name) == ("cuda", "rocm", "cpu")
    # ROCm builds of torch report the device type "cuda".
    assert (cuda.device_type, rocm.device_type, cpu.device_type) == ("cuda", "cuda", "cpu")
    for platform in (cuda, rocm, cpu):
        assert platform.eager_region_strategy == FullGraph()
        assert platform.name in platform.eager_region_reason
    assert rocm.v2_excluded_architectures == frozenset({"DeepseekV4ForCausalLM"})
    assert cuda.v2_excluded_architectures == cpu.v2_excluded_architectures == frozenset()
    assert "faster" in rocm.v2_exclusion_reason("DeepseekV4ForCausalLM")


def test_builtin_collective_policies() -> None:
    """NCCL (RCCL on ROCm) collectives are captured into graphs; gloo's on the CPU tape are not."""
    cuda, rocm, cpu = CudaPlatform(), RocmPlatform(), CpuPlatform()
    assert (cuda.collectives_capturable, rocm.collectives_capturable) == (True, True)
    assert cpu.collectives_capturable is False
    assert (cuda.distributed_backend, rocm.distributed_backend) == ("nccl", "nccl")
    assert cpu.distributed_backend == "gloo"
    assert cpu.collectives_reason == (
        "platform cpu cannot capture gloo collectives into a graph: gloo communicates from its "
        "own host threads, outside the ops the tape records"
    )
    assert cuda.collectives_reason == (
        "platform cuda can capture nccl collectives into a graph: NCCL kernels run on the "
        "capturing stream and are recorded into CUDA graphs like any other kernel"
    )
    assert rocm.collectives_reason == (
        "platform rocm can capture nccl collectives into a graph: torch serves nccl with RCCL "
        "on ROCm, whose kernels run on the capturing stream and are recorded into HIP graphs "
        "like any other kernel"
    )


def test_a_platform_that_never_heard_of_collectives_is_safe_by_default() -> None:
    """The parallelism attributes are optional: a platform written without them instantiates,
    and its collectives break (always correct), with a reason saying the attribute is unset."""
    assert "collectives_capturable" not in REQUIRED_ATTRIBUTES
    assert "distributed_backend" not in REQUIRED_ATTRIBUTES
    offline = OfflinePlatform()
    assert (offline.collectives_capturable, offline.distributed_backend) == (False, "gloo")
    assert offline.collectives_reason == (
        "platform offline cannot capture gloo collectives into a graph: it does not set "
        "collectives_capturable (the safe default)"
    )

    class Declared(OfflinePlatform):
        collectives_capturable = False
        distributed_backend = "xccl"

    class Capturing(Declared):
        collectives_capturable = True

    assert Declared().collectives_reason == (
        "platform offline cannot capture xccl collectives into a graph: it sets "
        "collectives_capturable = False"
    )
    assert Capturing().collectives_reason == (
        "platform offline can capture xccl collectives into a graph: it sets "
        "collectives_capturable = True"
    )


def test_availability_follows_this_torch_build() -> None:
    gpu = torch.cuda.is_available()
    hip = torch.version.hip is not None
    assert CpuPlatform().is_available()
    assert CudaPlatform().is_available() == (gpu and not hip)
    assert RocmPlatform().is_available() == (gpu and hip)


def test_cpu_platform_hands_out_tape_backends_each_with_a_fresh_pool() -> None:
    from graphs.tape import TapeBackend

    cpu = CpuPlatform()
    first, second = cpu.graph_backend(), cpu.graph_backend()
    assert isinstance(first, TapeBackend)
    # one pool per backend (per runner): a pool is never shared past its graphs' lifetime
    assert first.pool is not second.pool
    assert cpu.device == torch.device("cpu")


def test_abstract_members_are_enforced_at_instantiation() -> None:
    class Incomplete(Platform):
        name = "incomplete"

    with pytest.raises(TypeError, match=r"abstract.*create_graph_backend"):
        Incomplete()  # type: ignore[abstract]

    class PolicyLess(Platform):
        """The device part alone: no required attribute is set."""

        is_available = CpuPlatform.is_available
        create_memory_pool = CpuPlatform.create_memory_pool
        create_graph_backend = CpuPlatform.create_graph_backend

    with pytest.raises(TypeError, match="abstract platform PolicyLess") as refused:
        PolicyLess()
    for attr in REQUIRED_ATTRIBUTES:
        assert attr in str(refused.value)


def test_required_attributes_may_be_properties() -> None:
    class Computed(OfflinePlatform):
        @property
        def name(self) -> str:  # type: ignore[override]
            return "computed"

    assert Computed().name == "computed"


def test_unavailable_platform_refuses_a_backend_and_suggests_simulation() -> None:
    offline = OfflinePlatform()
    with pytest.raises(PlatformUnavailableError, match=r"unplugged.*simulate"):
        offline.graph_backend()
    with pytest.raises(PlatformUnavailableError, match="offline"):
        offline.require_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_platforms_are_unavailable_here_without_simulation() -> None:
    for name in ("cuda", "rocm"):
        with pytest.raises(PlatformUnavailableError, match=f"{name}.*simulate"):
            get_platform(name).graph_backend()


def test_simulate_keeps_the_policy_and_runs_on_the_cpu_tape() -> None:
    from graphs.tape import TapeBackend

    offline = OfflinePlatform()
    sim = simulate(offline)
    assert sim.simulated and not offline.simulated
    assert sim.name == "offline"
    assert sim.eager_region_strategy == WideRegion()
    assert sim.v2_excluded_architectures == offline.v2_excluded_architectures
    assert sim.eager_region_reason == offline.eager_region_reason
    assert sim.is_available()
    assert sim.device == torch.device("cpu")
    assert isinstance(sim.graph_backend(), TapeBackend)
    assert simulate(sim) == sim  # idempotent
    assert sim != offline
    assert hash(simulate(OfflinePlatform())) == hash(sim)
    assert simulate(OfflinePlatform()) == sim
    assert simulate(CpuPlatform()) != simulate(RocmPlatform())
    assert repr(sim) == "simulate(OfflinePlatform(name='offline'))"


def test_simulation_swaps_only_the_device_part() -> None:
    rocm = simulate(RocmPlatform())
    assert rocm.v2_exclusion_reason("DeepseekV4ForCausalLM") == RocmPlatform().v2_exclusion_reason(
        "DeepseekV4ForCausalLM"
    )
    assert rocm.unavailable_reason() == RocmPlatform().unavailable_reason()
    assert (rocm.device_type, rocm.is_available()) == ("cpu", True)
    assert isinstance(rocm, Platform) and not isinstance(rocm, RocmPlatform)


def test_simulation_keeps_the_collective_policy_and_talks_gloo() -> None:
    """Whether collectives can be captured is policy (read through); the process-group backend
    is the device part's: a simulated run's tensors are on the CPU, so gloo."""
    for platform in (CudaPlatform(), RocmPlatform(), CpuPlatform(), OfflinePlatform()):
        sim = simulate(platform)
        assert sim.collectives_capturable is platform.collectives_capturable
        assert sim.collectives_reason == platform.collectives_reason
        assert sim.distributed_backend == "gloo"


def test_a_new_policy_hook_reaches_simulated_platforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook a subclass adds, or one ``Platform`` gains with a default that a subclass
    overrides, is answered by the simulated platform as by the platform itself."""

    def kv_cache_reason(self: Platform) -> str:
        return f"platform {self.name} keeps the KV cache anywhere"

    monkeypatch.setattr(Platform, "kv_cache_reason", kv_cache_reason, raising=False)

    class Hooked(OfflinePlatform):
        def kv_cache_reason(self) -> str:
            return f"platform {self.name} pins its KV cache in device memory"

        def scratch_reason(self, size: int) -> str:
            return f"platform {self.name} needs {size} bytes of host-visible scratch"

    sim = simulate(Hooked())
    assert sim.kv_cache_reason() == "platform offline pins its KV cache in device memory"
    assert sim.scratch_reason(64) == "platform offline needs 64 bytes of host-visible scratch"
    assert simulate(CpuPlatform()).kv_cache_reason() == "platform cpu keeps the KV cache anywhere"


def test_platform_objects_compare_by_class_and_name() -> None:
    assert get_platform("rocm") == RocmPlatform()
    assert get_platform("rocm") is not get_platform("rocm")  # fresh objects, nothing cached
    assert CudaPlatform() != RocmPlatform()
    assert len({CudaPlatform(), CudaPlatform(), CpuPlatform()}) == 2


def test_unknown_platform_lists_the_registered_names() -> None:
    with pytest.raises(UnknownPlatformError, match=r"'tpu'.*cpu, cuda, rocm"):
        get_platform("tpu")


def test_register_platform_adds_a_name_and_refuses_another_class_under_it() -> None:
    class Impostor(OfflinePlatform):
        """Another class carrying the name ``offline``."""

    assert register_platform(OfflinePlatform) is OfflinePlatform
    try:
        assert get_platform("offline") == OfflinePlatform()
        assert register_platform(OfflinePlatform) is OfflinePlatform  # the same platform again
        with pytest.raises(PlatformRegistrationError, match="already registered by Offline"):
            register_platform(Impostor)
        assert type(get_platform("offline")) is OfflinePlatform
    finally:
        unregister_platform("offline")
    with pytest.raises(UnknownPlatformError):
        get_platform("offline")


def test_register_refuses_what_is_not_a_platform() -> None:
    with pytest.raises(PlatformRegistrationError, match="not a subclass"):
        PlatformRegistry().register(int)  # type: ignore[type-var]


def test_current_platform_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_PLATFORM", "cpu")
    assert current_platform() == CpuPlatform()
    monkeypatch.setenv("DSV4_PLATFORM", "tpu")
    with pytest.raises(UnknownPlatformError, match="tpu"):
        current_platform()


def test_current_platform_refuses_an_unavailable_override(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = PlatformRegistry((CpuPlatform, OfflinePlatform))
    with pytest.raises(PlatformUnavailableError, match="offline"):
        registry.current({"DSV4_PLATFORM": "offline"})


def test_current_platform_is_decided_on_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSV4_PLATFORM", raising=False)
    detected = current_platform()
    assert detected.is_available()
    if not torch.cuda.is_available():
        assert detected == CpuPlatform()
    monkeypatch.setenv("DSV4_PLATFORM", "cpu")
    assert current_platform() == CpuPlatform()  # no cache to clear in between


def test_registered_out_of_tree_platform_wins_detection_when_available() -> None:
    class Accel(CpuPlatform):
        name = "accel"

    registry = PlatformRegistry()
    assert registry.current({}).name in ("cpu", "cuda", "rocm")
    registry.register(Accel)
    assert registry.current({}).name == "accel"
    assert "accel" in registry.names()
