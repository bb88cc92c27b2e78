"""Our three platforms pass the conformance kit platform authors use.

The CUDA and ROCm classes run on their devices where available and simulated on the CPU
otherwise, so the cross-strategy property suite runs under all three platform policies. The
README's out-of-tree example runs the kit in a package of its own (``test_plugin_package.py``).
"""

from __future__ import annotations

from platforms import CpuPlatform, CudaPlatform, Platform, RocmPlatform
from runners.testing import PlatformConformanceTests


class TestCpuPlatform(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CpuPlatform()


class TestCudaPlatform(PlatformConformanceTests):
    captures_collectives = True

    def make_platform(self) -> Platform:
        return CudaPlatform()


class TestRocmPlatform(PlatformConformanceTests):
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})
    captures_collectives = True

    def make_platform(self) -> Platform:
        return RocmPlatform()
