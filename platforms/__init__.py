"""Platforms: the ``Platform`` ABC, the CUDA, ROCm and CPU platforms, the registry and plugins.

A platform is a policy object (required eager region, V2-default exclusions, graph backend,
memory pool). Nothing is resolved at import time: ``get_platform(name)`` looks a named platform
up (an explicit name always wins), ``current_platform()`` decides on each call when none is
named. The conformance kit for platform authors is ``platforms.testing`` (test-time only, not
imported here). Imports ``graphs`` only.
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
