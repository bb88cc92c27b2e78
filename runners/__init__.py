"""Model runners: persistent inputs, capture sizes and dispatch, graph modes, and resolution.

``resolve`` turns (architecture, platform, user overrides) into a ``Resolution`` whose runner
class, graph modes and eager region follow DESIGN §3, with a reason for every choice;
``build_runner`` builds the runner over a model (``build_engine`` does all of it from an
``EngineSpec``), and ``LLM`` (the engine) drives it; ``launch_engine`` does the same over
local rank processes, for a model split across them.
Imports ``graphs``, ``platforms`` and ``dsv4``; nothing is resolved at import time.
"""

from graphs.errors import InputError
from runners.base import ModelRunner
from runners.batch import DEFAULT_CAPTURE_SIZES
from runners.engine import LLM, RequestFailedError, SamplingParams
from runners.errors import (
    CaptureSizeError,
    ResolutionError,
    RunnerInputError,
    UnknownEagerRegionError,
    UnknownModeError,
    UnknownRunnerError,
    UnsafeRegionError,
)
from runners.layout import CacheLayout
from runners.modes import CUDAGraphMode
from runners.ranked import RankedEngine, launch_engine
from runners.resolution import (
    DEFAULT_V2_ARCHITECTURES,
    RUNNER_ENV,
    Resolution,
    resolve,
    runner_from_name,
)
from runners.spec import Engine, EngineSpec, build_engine, build_runner
from runners.v1 import ModelRunnerV1
from runners.v2 import ModelRunnerV2

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "DEFAULT_V2_ARCHITECTURES",
    "LLM",
    "RUNNER_ENV",
    "CUDAGraphMode",
    "CacheLayout",
    "CaptureSizeError",
    "Engine",
    "EngineSpec",
    "InputError",
    "ModelRunner",
    "ModelRunnerV1",
    "ModelRunnerV2",
    "RankedEngine",
    "RequestFailedError",
    "Resolution",
    "ResolutionError",
    "RunnerInputError",
    "SamplingParams",
    "UnknownEagerRegionError",
    "UnknownModeError",
    "UnknownRunnerError",
    "UnsafeRegionError",
    "build_engine",
    "build_runner",
    "launch_engine",
    "resolve",
    "runner_from_name",
]
