"""``resolve``: (architecture, platform, user overrides) -> a frozen ``Resolution`` with reasons.

The rules (DESIGN §3), applied in this order, each choice and downgrade recorded as a reason:

1. Runner: an explicit choice (argument, else ``DSV4_RUNNER=v1|v2``) wins; otherwise
   ``ModelRunnerV2`` for architectures in ``DEFAULT_V2_ARCHITECTURES`` minus the platform's
   exclusions, ``ModelRunnerV1`` for everything else.
2. Collectives (DESIGN §9): at a tensor parallel size above 1 the run issues collectives, and
   the platform's ``collectives_capturable`` says whether they are captured inside the graphs or
   each one is an eager break; one reason says which, quoting ``collectives_reason``. A
   simulated platform keeps the real platform's policy here, though its run on the CPU tape
   breaks around every collective (``Resolution.collectives_in_graph``).
3. Graph mode per batch kind, from the requested mode (default ``FULL_AND_PIECEWISE``). FULL
   graphs serve uniform-decode batches only, so a mixed FULL becomes PIECEWISE; a decode FULL is
   kept only where ``join(platform, runner)`` is ``FullGraph`` and, at a parallel size above 1,
   the run captures its collectives (a full graph has no eager break for them: so never when
   simulated on the tape, whatever the real platform can do); it is otherwise downgraded to
   PIECEWISE.
4. Eager region: the join of the platform's, the runner's and the capturing modes' requirements
   (``join(platform, runner, NarrowRegion)`` whenever a kind runs PIECEWISE; ``NoGraph`` when
   nothing is captured). The user may widen it freely; a narrower request raises
   ``UnsafeRegionError`` naming the requirement and its reason, unless ``unsafe_region`` is set,
   in which case it is used and recorded.

Invariants: the result is a pure function of its arguments, the platform object and the
``DSV4_RUNNER`` value passed in (read from the environment when not given); nothing is cached. At
tensor parallel size 1 (no collectives) modes, region and reasons are exactly those of a
single-process resolution: no reason mentions collectives. A decode FULL never survives a parallel
size above 1 where the run breaks around collectives (``collectives_in_graph`` false).
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
from runners.errors import (
    ParallelSizeError,
    UnknownEagerRegionError,
    UnknownRunnerError,
    UnsafeRegionError,
)
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
    tensor_parallel_size: int
    """Ranks the model is split over (>= 1); above 1 the run issues collectives."""
    reasons: tuple[str, ...]

    def mode_for(self, *, uniform_decode: bool) -> CUDAGraphMode:
        return self.decode_mode if uniform_decode else self.mixed_mode

    @property
    def collectives_in_graph(self) -> bool:
        """Whether the run records its collectives into its graphs; otherwise the runner breaks
        around each one. False on the CPU tape (a simulated platform included, whatever the
        policy it simulates says) and wherever the platform cannot capture them; independent
        of the parallel size (at size 1 there is nothing to capture)."""
        return bool(self.platform.collectives_capturable) and not self.platform.simulated

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
            "tensor_parallel_size": self.tensor_parallel_size,
            "distributed_backend": self.platform.distributed_backend,
            "collectives_in_graph": self.collectives_in_graph,
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
    tensor_parallel_size: int = 1,
    environ: Mapping[str, str] | None = None,
) -> Resolution:
    """Resolve a run's runner, graph modes and eager region; see the module docs for the rules.

    ``platform`` may be a platform object, a registered name, or ``None`` for
    ``current_platform()``. ``runner``, ``cudagraph_mode`` and ``eager_region`` accept ``None``
    or ``"auto"`` for the default. ``tensor_parallel_size`` is the number of ranks (an integer
    >= 1, else ``ParallelSizeError``). ``environ`` replaces ``os.environ`` for ``DSV4_RUNNER``.
    """
    size = _parallel_size(tensor_parallel_size)
    reasons: list[str] = []
    plat = _platform(platform, reasons)
    env = os.environ if environ is None else environ
    runner_cls, runner_reason = _runner(architecture, plat, runner, env)
    reasons.append(runner_reason)
    if size > 1:
        reasons.append(_collectives(plat, size))
    asked = _asked_region(eager_region)
    decode, mixed = _modes(plat, runner_cls, cudagraph_mode, asked, size, reasons)
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
        tensor_parallel_size=size,
        reasons=tuple(reasons),
    )


def _parallel_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ParallelSizeError(f"tensor parallel size must be an integer >= 1, got {size!r}")
    return size


def _collectives(platform: Platform, size: int) -> str:
    """The reason saying where a parallel run's collectives go, in the platform's words."""
    head = f"tensor parallel size {size}"
    why = platform.collectives_reason
    if not platform.collectives_capturable:
        return f"{head}: each collective is an eager break ({why})"
    if platform.simulated:
        return (
            f"{head}: collectives are captured inside the graphs on the device ({why}); "
            "simulated on the CPU tape, the run breaks around each one instead"
        )
    return f"{head}: collectives are captured inside the graphs ({why})"


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
    tensor_parallel_size: int,
    reasons: list[str],
) -> tuple[CUDAGraphMode, CUDAGraphMode]:
    """The basic modes of decode and mixed batches. ``region`` is the eager region the user
    asked for (``None``: auto): ``no-graph`` keeps the attention layers out of every graph, so
    it downgrades FULL decode graphs too; any other explicit region leaves them FULL, with a
    reason saying that the region applies to PIECEWISE graphs only. Collectives that must break
    (``tensor_parallel_size`` above 1 on a platform that cannot capture them) downgrade FULL
    decode graphs as well. One downgrade reason is given, the first that applies: the region
    the platform or runner requires, the ``no-graph`` region asked for, then collectives (so a
    collectives reason appears only where nothing else would have downgraded)."""
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
    elif (
        decode is CUDAGraphMode.FULL
        and tensor_parallel_size > 1
        and not (platform.collectives_capturable and not platform.simulated)
    ):
        decode = CUDAGraphMode.PIECEWISE
        cannot = (
            "breaks around collectives on the CPU tape"
            if platform.collectives_capturable
            else "cannot capture collectives"
        )
        reasons.append(
            f"decode batches: FULL downgraded to PIECEWISE: platform {platform.name} {cannot} "
            f"at tensor parallel size {tensor_parallel_size}, and a full graph has no eager "
            "break"
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
