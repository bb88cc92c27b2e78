"""Exception types of resolution and of the model runners; each message is one actionable line."""

from __future__ import annotations

import dsv4.parallel as model_parallel
from graphs.errors import InputError

__all__ = [
    "CaptureSizeError",
    "DeviceCountError",
    "ParallelSizeError",
    "PlatformNotImportableError",
    "ResolutionError",
    "RunnerInputError",
    "SpecError",
    "UnknownEagerRegionError",
    "UnknownModeError",
    "UnknownRunnerError",
    "UnsafeRegionError",
    "UnsupportedDtypeError",
]


class ResolutionError(InputError, ValueError):
    """A (platform, runner, mode, region) request that cannot be resolved."""


class UnknownRunnerError(ResolutionError):
    """A runner name other than ``auto``, ``v1`` or ``v2`` (argument or ``DSV4_RUNNER``)."""


class UnknownModeError(ResolutionError):
    """A graph-mode name that is not a ``CUDAGraphMode`` member (or ``auto``)."""


class UnknownEagerRegionError(ResolutionError):
    """An eager-region name that is not one of the four strategies (or ``auto``)."""


class ParallelSizeError(ResolutionError, model_parallel.ParallelSizeError):
    """A parallel size that is not an integer >= 1 (the resolution's refusal; the model's, of a
    size that does not divide it, is the base class ``dsv4.parallel.ParallelSizeError``)."""


class DeviceCountError(ParallelSizeError):
    """More local ranks than the platform has devices on this machine (each takes one)."""


class PlatformNotImportableError(InputError, ValueError):
    """A platform object whose class the rank processes of ``launch_engine`` cannot import (one
    defined in the launching script's ``__main__``)."""


class UnsafeRegionError(ResolutionError):
    """An eager region narrower than the platform, runner and mode require, without the unsafe
    flag. Capturing it would replay metadata-dependent work against stale memory."""


class UnsupportedDtypeError(InputError, ValueError):
    """A compute dtype the platform's device cannot compute in (a bad ``--dtype``, or the
    checkpoint's ``torch_dtype`` under ``auto``): the message names the dtype, the reason and
    the choices."""


class CaptureSizeError(InputError, ValueError):
    """Capture sizes that are empty, non-positive or larger than what one step can carry (the
    runner's token budget), or context buckets without a positive width."""


class RunnerInputError(InputError, ValueError):
    """A step handed to a runner that does not fit it (token counts, rows, blocks, budget)."""


class SpecError(InputError, ValueError):
    """An ``EngineSpec`` field outside its choices (the message names the field, the value and
    the choices)."""
