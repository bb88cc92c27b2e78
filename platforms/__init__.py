"""Platforms: the ``Platform`` ABC, the CUDA, ROCm and CPU platforms, ``simulate``, the registry
and plugins.

A platform is policy (its name, required eager region, V2-default exclusions, whether its
collectives can be captured into a graph, and the reasons for each) plus a device part (device
type, availability, ``torch.distributed`` backend, memory pool, graph backend);
``simulate(platform)`` keeps the policy and swaps the device part for the CPU tape's. Nothing is
resolved at import time: ``get_platform(name)`` looks a named platform up (an explicit name
always wins), ``current_platform()`` decides on each call when none is named. Imports ``graphs``
(and torch) only; the conformance kit for platform authors drives the whole stack, so it lives on
the top floor, in ``runners.testing``.
"""

from platforms.base import Platform
from platforms.cpu import CpuPlatform
from platforms.cuda import CudaPlatform
from platforms.errors import (
    AmbiguousPlatformError,
    PlatformError,
    PlatformPluginError,
    PlatformRegistrationError,
    PlatformUnavailableError,
    UnknownPlatformError,
)
from platforms.registry import (
    ENTRY_POINT_GROUP,
    PLATFORM_ENV,
    PlatformRegistry,
    current_platform,
    get_platform,
    platform_names,
    register_platform,
    unregister_platform,
)
from platforms.rocm import RocmPlatform
from platforms.simulate import SimulatedPlatform, simulate

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV",
    "AmbiguousPlatformError",
    "CpuPlatform",
    "CudaPlatform",
    "Platform",
    "PlatformError",
    "PlatformPluginError",
    "PlatformRegistrationError",
    "PlatformRegistry",
    "PlatformUnavailableError",
    "RocmPlatform",
    "SimulatedPlatform",
    "UnknownPlatformError",
    "current_platform",
    "get_platform",
    "platform_names",
    "register_platform",
    "simulate",
    "unregister_platform",
]
