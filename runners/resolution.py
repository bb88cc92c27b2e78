"""``resolve``: (architecture, platform, user overrides) -> a frozen ``Resolution`` with reasons.

The rules (DESIGN §3), applied in this order, each choice and downgrade recorded as a reason:

1. Runner: an explicit choice (argument, else ``DSV4_RUNNER=v1|v2``) wins; otherwise
   ``ModelRunnerV2`` for architectures in ``DEFAULT_V2_ARCHITECTURES`` minus the platform's
   exclusions, ``ModelRunnerV1`` for everything else.
2. Graph mode per batch kind, from the requested mode (default ``FULL_AND_PIECEWISE``). FULL
   graphs serve uniform-decode batches only, so a mixed FULL becomes PIECEWISE; a decode FULL is
   kept only where ``join(platform, runner)`` is ``FullGraph`` and is otherwise downgraded to
   PIECEWISE.
3. Eager region: the join of the platform's, the runner's and the capturing modes' requirements
   (``join(platform, runner, NarrowRegion)`` whenever a kind runs PIECEWISE; ``NoGraph`` when
   nothing is captured). The user may widen it freely; a narrower request raises
   ``UnsafeRegionError`` naming the requirement and its reason, unless ``unsafe_region`` is set,
   in which case it is used and recorded.

Invariant: the result is a pure function of its arguments, the platform object and the
``DSV4_RUNNER`` value passed in (read from the environment when not given); nothing is cached.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from dsv4.config import ARCHITECTURE
from graphs.strategies import EagerRegionStrategy, FullGraph, NoGraph, strategy_from_name
from platforms import Platform, current_platform, get_platform
from runners.base import ModelRunner
from runners.errors import UnknownEagerRegionError, UnknownRunnerError, UnsafeRegionError
from runners.modes import CUDAGraphMode
from runners.v1 import ModelRunnerV1
from runners.v2 import ModelRunnerV2

__all__ = [
    "DEFAULT_CUDAGRAPH_MODE",
    "DEFAULT_V2_ARCHITECTURES",
    "RUNNERS",
    "RUNNER_ENV",
    "Resolution",
    "resolve",
    "runner_from_name",
]

DEFAULT_V2_ARCHITECTURES: frozenset[str] = frozenset({ARCHITECTURE})
DEFAULT_CUDAGRAPH_MODE = CUDAGraphMode.FULL_AND_PIECEWISE
RUNNER_ENV = "DSV4_RUNNER"
RUNNERS: dict[str, type[ModelRunner]] = {"v1": ModelRunnerV1, "v2": ModelRunnerV2}
_AUTO = ("", "auto")


@attrs.frozen(kw_only=True)
class Resolution:
    """Everything a run needs to know about how it will capture, and why."""

    architecture: str
    platform: Platform
    runner: type[ModelRunner]
    decode_mode: CUDAGraphMode
    """Basic mode of uniform-decode batches."""
    mixed_mode: CUDAGraphMode
    """Basic mode of mixed batches (never FULL)."""
    eager_region: EagerRegionStrategy
    required_region: EagerRegionStrategy
    unsafe_region: bool
    """True when ``eager_region`` is narrower than ``required_region`` (by explicit request)."""
    reasons: tuple[str, ...]

    def mode_for(self, *, uniform_decode: bool) -> CUDAGraphMode:
        return self.decode_mode if uniform_decode else self.mixed_mode

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used by the CLI (DESIGN §7 keys)."""
        return {
            "architecture": self.architecture,
            "platform": self.platform.name,
            "simulated": self.platform.simulated,
            "runner": self.runner.name,
            "cudagraph_mode": {"decode": self.decode_mode.name, "mixed": self.mixed_mode.name},
            "eager_region": self.eager_region.name,
            "required_region": self.required_region.name,
            "unsafe_region": self.unsafe_region,
            "reasons": list(self.reasons),
        }


def resolve(
    architecture: str,
    platform: Platform | str | None,
    runner: str | type[ModelRunner] | None = None,
    cudagraph_mode: CUDAGraphMode | str | None = None,
    eager_region: EagerRegionStrategy | str | None = None,
    unsafe_region: bool = False,
    *,
    environ: Mapping[str, str] | None = None,
) -> Resolution:
    """Resolve a run's runner, graph modes and eager region; see the module docs for the rules.

    ``platform`` may be a platform object, a registered name, or ``None`` for
    ``current_platform()``. ``runner``, ``cudagraph_mode`` and ``eager_region`` accept ``None``
    or ``"auto"`` for the default. ``environ`` replaces ``os.environ`` for ``DSV4_RUNNER``.
    """
    reasons: list[str] = []
    plat = _platform(platform, reasons)
    env = os.environ if environ is None else environ
    runner_cls, runner_reason = _runner(architecture, plat, runner, env)
    reasons.append(runner_reason)
    asked = _asked_region(eager_region)
    decode, mixed = _modes(plat, runner_cls, cudagraph_mode, asked, reasons)
    required, why = _required_region(plat, runner_cls, (decode, mixed))
    reasons.append(f"eager region {required} required by {why}")
    region, unsafe = _region(asked, required, why, unsafe_region, reasons)
    return Resolution(
        architecture=architecture,
        platform=plat,
        runner=runner_cls,
        decode_mode=decode,
        mixed_mode=mixed,
        eager_region=region,
        required_region=required,
        unsafe_region=unsafe,
        reasons=tuple(reasons),
    )


def _platform(platform: Platform | str | None, reasons: list[str]) -> Platform:
    if platform is None:
        found = current_platform()
        reasons.append(f"platform {found.name}: detected on this machine")
        return found
    found = get_platform(platform) if isinstance(platform, str) else platform
    how = "simulated on the CPU" if found.simulated else "given"
    reasons.append(f"platform {found.name}: {how}")
    return found


def runner_from_name(name: str, *, source: str = "runner") -> type[ModelRunner]:
    """``v1``/``v2`` (any case) to a runner class; ``UnknownRunnerError`` lists the names."""
    try:
        return RUNNERS[name.strip().lower()]
    except KeyError:
        valid = ", ".join(["auto", *RUNNERS])
        raise UnknownRunnerError(f"unknown {source} {name!r}; expected one of: {valid}") from None


def _runner(
    architecture: str,
    platform: Platform,
    runner: str | type[ModelRunner] | None,
    environ: Mapping[str, str],
) -> tuple[type[ModelRunner], str]:
    if isinstance(runner, type):
        if not issubclass(runner, ModelRunner):
            raise UnknownRunnerError(f"{runner!r} is not a ModelRunner subclass")
        return runner, f"runner {runner.name}: chosen explicitly"
    if runner is not None and runner.strip().lower() not in _AUTO:
        return runner_from_name(runner), f"runner {runner.strip().lower()}: chosen explicitly"
    env = environ.get(RUNNER_ENV, "")
    if env.strip().lower() not in _AUTO:
        chosen = runner_from_name(env, source=f"{RUNNER_ENV} value")
        return chosen, f"runner {chosen.name}: chosen by {RUNNER_ENV}"
    if architecture not in DEFAULT_V2_ARCHITECTURES:
        return ModelRunnerV1, f"runner v1: {architecture} is not in the ModelRunnerV2 default set"
    if architecture in platform.v2_excluded_architectures:
        return ModelRunnerV1, f"runner v1: {platform.v2_exclusion_reason(architecture)}"
    return ModelRunnerV2, f"runner v2: {architecture} is in the ModelRunnerV2 default set"


def _modes(
    platform: Platform,
    runner: type[ModelRunner],
    requested: CUDAGraphMode | str | None,
    region: EagerRegionStrategy | None,
    reasons: list[str],
) -> tuple[CUDAGraphMode, CUDAGraphMode]:
    """The basic modes of decode and mixed batches. ``region`` is the eager region the user
    asked for (``None``: auto): ``no-graph`` keeps the attention layers out of every graph, so
    it downgrades FULL decode graphs too; any other explicit region leaves them FULL, with a
    reason saying that the region applies to PIECEWISE graphs only."""
    if requested is None or (isinstance(requested, str) and requested.strip().lower() in _AUTO):
        mode = DEFAULT_CUDAGRAPH_MODE
        reasons.append(f"cudagraph mode {mode.name}: the default")
    else:
        mode = (
            requested
            if isinstance(requested, CUDAGraphMode)
            else CUDAGraphMode.from_name(requested)
        )
        reasons.append(f"cudagraph mode {mode.name}: chosen explicitly")
    decode, mixed = mode.decode_mode(), mode.mixed_mode()
    if mixed is CUDAGraphMode.FULL:
        mixed = CUDAGraphMode.PIECEWISE
        reasons.append(
            "mixed batches: FULL downgraded to PIECEWISE: full graphs are captured for "
            "uniform-decode batches only"
        )
    base, who, why = _join([_platform_req(platform), _runner_req(runner)])
    if decode is CUDAGraphMode.FULL and base != FullGraph():
        decode = CUDAGraphMode.PIECEWISE
        reasons.append(
            f"decode batches: FULL downgraded to PIECEWISE: {who} requires the {base} region "
            f"({why}), and a full graph has no eager region"
        )
    elif decode is CUDAGraphMode.FULL and region == NoGraph():
        decode = CUDAGraphMode.PIECEWISE
        reasons.append(
            f"decode batches: FULL downgraded to PIECEWISE: eager region {region} was asked "
            "for, and a full graph would capture the attention layers"
        )
    elif decode is CUDAGraphMode.FULL and region is not None:
        reasons.append(
            f"decode batches: FULL graphs capture whole steps; eager region {region} applies "
            "to PIECEWISE graphs"
        )
    return decode, mixed


def _asked_region(requested: EagerRegionStrategy | str | None) -> EagerRegionStrategy | None:
    """The region the caller asked for, or ``None`` for the default (``auto``)."""
    if requested is None or isinstance(requested, EagerRegionStrategy):
        return requested
    name = requested.strip().lower()
    if name in _AUTO:
        return None
    try:
        return strategy_from_name(name)
    except ValueError as exc:
        raise UnknownEagerRegionError(str(exc)) from None


_Requirement = tuple[EagerRegionStrategy, str, str]


def _platform_req(platform: Platform) -> _Requirement:
    return platform.eager_region_strategy, f"platform {platform.name}", platform.eager_region_reason


def _runner_req(runner: type[ModelRunner]) -> _Requirement:
    return runner.eager_region_strategy, f"runner {runner.name}", runner.eager_region_reason


def _join(requirements: list[_Requirement]) -> _Requirement:
    """The widest requirement; on ties the first listed is named (platform, runner, mode)."""
    widest = requirements[0]
    for req in requirements[1:]:
        if req[0] > widest[0]:
            widest = req
    return widest


def _required_region(
    platform: Platform, runner: type[ModelRunner], modes: tuple[CUDAGraphMode, CUDAGraphMode]
) -> tuple[EagerRegionStrategy, str]:
    capturing = [m for m in dict.fromkeys(modes) if m is not CUDAGraphMode.NONE]
    if not capturing:
        return NoGraph(), CUDAGraphMode.NONE.requirement_reason
    mode_reqs = [(m.required_strategy, f"mode {m.name}", m.requirement_reason) for m in capturing]
    reqs = [_platform_req(platform), _runner_req(runner), *mode_reqs]
    strategy, who, why = _join(reqs)
    parts = ", ".join(f"{name} {req}" for req, name, _ in reqs)
    return strategy, f"{who} (widest of {parts}): {why}"


def _region(
    asked: EagerRegionStrategy | None,
    required: EagerRegionStrategy,
    why: str,
    unsafe: bool,
    reasons: list[str],
) -> tuple[EagerRegionStrategy, bool]:
    if asked is None:
        return required, False
    if asked.covers(required):
        if asked != required:
            reasons.append(f"eager region {asked}: widened from {required} by request")
        return asked, False
    if not unsafe:
        raise UnsafeRegionError(
            f"eager region {asked} is narrower than the {required} region required by {why}; "
            "pass unsafe_region=True (CLI --unsafe-region) only for experiments"
        )
    reasons.append(
        f"UNSAFE eager region {asked}: narrower than the required {required} ({why}); "
        "captured work may replay stale memory and the capture audit will report it"
    )
    return asked, True
