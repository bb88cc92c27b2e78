"""Our three platforms pass the conformance kit platform authors use.

The CUDA and ROCm classes run on their devices (behind the ``cuda`` marker: skipped, with the
reason, where no GPU is available); their ``Simulated`` twins run the same policies simulated on
the CPU tape everywhere (``run_on_device = False``), so the cross-strategy property suite runs
under all three platform policies on any machine. The README's out-of-tree example runs the kit
in a package of its own (``test_plugin_package.py``).
"""

from __future__ import annotations

import pytest

from platforms import CpuPlatform, CudaPlatform, Platform, RocmPlatform
from runners.testing import PlatformConformanceTests


class TestCpuPlatform(PlatformConformanceTests):
    def make_platform(self) -> Platform:
        return CpuPlatform()


class CudaPolicy:
    """The CUDA platform and what the kit must find in its policy."""

    captures_collectives = True

    def make_platform(self) -> Platform:
        return CudaPlatform()


class RocmPolicy:
    """The ROCm platform and what the kit must find in its policy."""

    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})
    captures_collectives = True

    def make_platform(self) -> Platform:
        return RocmPlatform()


@pytest.mark.cuda
class TestCudaPlatform(CudaPolicy, PlatformConformanceTests):
    pass


class TestSimulatedCudaPlatform(CudaPolicy, PlatformConformanceTests):
    run_on_device = False


@pytest.mark.cuda
class TestRocmPlatform(RocmPolicy, PlatformConformanceTests):
    pass


class TestSimulatedRocmPlatform(RocmPolicy, PlatformConformanceTests):
    run_on_device = False
