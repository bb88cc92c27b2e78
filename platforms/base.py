"""The ``Platform`` ABC: what a device family contributes to graph capture and runner choice.

A platform is a *policy object*. It answers four questions the resolution asks (DESIGN §3) —
is it available here, which eager region does it require, which architectures does it exclude
from the ``ModelRunnerV2`` default, and why — and it supplies graph backends, each recording
into a memory pool of its own.

Invariants:
- Nothing here is resolved or cached at import time or process-wide: every default that depends
  on the platform is a method or property of the platform object, so two platform objects in one
  process never see each other's answers and tests never clear a cache.
- Every backend ``graph_backend()`` hands out records into a fresh pool of its own: captures of
  one runner (several sizes) share it, two runners never do, and a pool whose graphs are all
  gone is never recorded into again (a runner that drops its graphs takes a new backend).
- A platform whose device is missing can still be inspected and resolved (``dsv4 explain`` works
  for every platform on any machine); asking it for a backend raises
  ``PlatformUnavailableError``. ``simulate(platform)`` runs the same policy on the CPU.
- Platforms compare equal when they are of the same class and carry the same name.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from graphs.backend import GraphBackend
from graphs.strategies import EagerRegionStrategy, FullGraph
from platforms.errors import PlatformUnavailableError

__all__ = ["Platform"]


class Platform(abc.ABC):
    """Base class of every platform; subclass it and implement the abstract members.

    A subclass that leaves an abstract member out fails at instantiation, not at first use.
    """

    simulated: bool = False
    """True for ``simulate(platform)``: the policy of a device platform run on the CPU."""

    # -- identity and availability ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Stable lower-case name used by the registry, ``DSV4_PLATFORM`` and the CLI."""

    @property
    @abc.abstractmethod
    def device_type(self) -> str:
        """The torch device type tensors live on (ROCm builds of torch also report ``cuda``)."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when this machine can run the platform's device and graph backend."""

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is false, in words a person can act on."""
        return f"no {self.device_type} device is usable by this build of torch"

    # -- policy ------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def eager_region_strategy(self) -> EagerRegionStrategy:
        """The narrowest eager region this platform can capture correctly."""

    @property
    def eager_region_reason(self) -> str:
        """Why the platform requires ``eager_region_strategy`` (recorded in resolutions)."""
        if self.eager_region_strategy == FullGraph():
            return f"platform {self.name} requires nothing beyond the graph mode"
        return f"platform {self.name} requires the {self.eager_region_strategy} region"

    @property
    @abc.abstractmethod
    def v2_excluded_architectures(self) -> frozenset[str]:
        """Architectures that default to ``ModelRunnerV1`` here although V2 is the default."""

    def v2_exclusion_reason(self, architecture: str) -> str:
        """Why ``architecture`` is excluded from the V2 default on this platform."""
        return f"platform {self.name} excludes {architecture} from the ModelRunnerV2 default"

    # -- memory and graph backend ----------------------------------------------------------------
    @abc.abstractmethod
    def create_memory_pool(self) -> Any:
        """Create a fresh memory pool (one per backend ``graph_backend`` hands out)."""

    @abc.abstractmethod
    def create_graph_backend(self, pool: Any) -> GraphBackend:
        """Create a graph backend that records into ``pool``."""

    def graph_backend(self) -> GraphBackend:
        """A new graph backend for this platform, recording into a fresh memory pool."""
        self.require_available()
        return self.create_graph_backend(self.create_memory_pool())

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def require_available(self) -> None:
        """Raise ``PlatformUnavailableError`` unless the platform can run on this machine."""
        if not self.is_available():
            raise PlatformUnavailableError(
                f"platform {self.name!r} is not available on this machine "
                f"({self.unavailable_reason()}); run its policy on the CPU with "
                f"simulate(get_platform({self.name!r})) (CLI: --simulate)"
            )

    # -- value semantics ---------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.name == other.name

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
