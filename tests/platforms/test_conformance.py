"""Our three platforms pass the conformance kit platform authors use.

The CUDA and ROCm classes run on their devices where available and simulated on the CPU
otherwise, so the cross-strategy property suite runs under all three platform policies.
"""

from __future__ import annotations

from typing import Any

from graphs import WideRegion
from graphs.backend import GraphBackend
from platforms import CpuPlatform, CudaPlatform, Platform, RocmPlatform
from platforms.cpu import tape_backend, tape_memory_pool
from platforms.testing import PlatformConformanceTests


class TestCpuPlatform(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CpuPlatform()


class TestCudaPlatform(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CudaPlatform()


class TestRocmPlatform(PlatformConformanceTests):
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

    def make_platform(self) -> Platform:
        return RocmPlatform()


class WideOnlyPlatform(Platform):
    """The README's example: an out-of-tree platform whose captures need the wide region."""

    name = "mydev"
    device_type = "cpu"
    eager_region_strategy = WideRegion()
    v2_excluded_architectures = frozenset({"DeepseekV4ForCausalLM"})

    def is_available(self) -> bool:
        return True

    def create_memory_pool(self) -> Any:
        return tape_memory_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return tape_backend(pool)


class TestWideOnlyPlatform(PlatformConformanceTests):
    required_region = "wide"
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

    def make_platform(self) -> Platform:
        return WideOnlyPlatform()
