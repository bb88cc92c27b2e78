"""The ``Platform`` ABC: what a device family contributes to graph capture and runner choice.

A platform is *policy* plus a *device part*. The policy answers what the resolution asks (DESIGN
§3, §9): the platform's ``name``, the eager region it requires, the architectures it excludes from
the ``ModelRunnerV2`` default, whether its collectives can be captured into a graph (class
attributes), and why (the reason hooks). The device part is where that policy runs:
``device_type``, ``is_available()``, the ``torch.distributed`` backend its collectives use, and the
memory pool and graph backend that captures record into (warm-up is the backend's business).
``simulate(platform)`` swaps the device part for the CPU tape's and keeps the whole policy.

Invariants:
- Nothing here is resolved or cached at import time or process-wide: every default that depends
  on the platform is an attribute or method of the platform object, so two platform objects in
  one process never see each other's answers and tests never clear a cache.
- Every backend ``graph_backend()`` hands out records into a fresh pool of its own: captures of
  one runner (several sizes) share it, two runners never do, and a pool whose graphs are all
  gone is never recorded into again (a runner that drops its graphs takes a new backend).
- A platform whose device is missing can still be inspected and resolved (``dsv4 explain`` works
  for every platform on any machine); asking it for a backend raises
  ``PlatformUnavailableError``.
- Platforms compare equal when they are of the same class and carry the same name.
- The parallelism attributes are optional, with defaults that are always correct:
  ``collectives_capturable = False`` (each collective is an eager break, so FULL graphs are
  downgraded at a parallel size above 1) and ``distributed_backend = "gloo"``. A platform written
  before parallelism existed, or whose author never heard of them, instantiates and runs; setting
  ``collectives_capturable = True`` is a claim that its communicator records into its graphs.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from graphs.backend import GraphBackend
from graphs.strategies import EagerRegionStrategy, FullGraph
from platforms.errors import PlatformUnavailableError

__all__ = ["REQUIRED_ATTRIBUTES", "Platform"]

REQUIRED_ATTRIBUTES = ("name", "device_type", "eager_region_strategy", "v2_excluded_architectures")
"""What every concrete platform sets (as class attributes, or as properties). The parallelism
attributes (``collectives_capturable``, ``distributed_backend``) are not among them: their
defaults are safe."""


class Platform(abc.ABC):
    """Base class of every platform: set the required attributes, implement the device part.

    A subclass that leaves out a required attribute or an abstract method fails at instantiation
    with a ``TypeError`` naming what is missing, not at first use (a subclass that defines
    ``__init__`` calls ``super().__init__()``).
    """

    # -- policy ------------------------------------------------------------------------------------
    name: str
    """Stable lower-case name used by the registry, ``DSV4_PLATFORM`` and the CLI."""
    eager_region_strategy: EagerRegionStrategy
    """The narrowest eager region this platform can capture correctly."""
    v2_excluded_architectures: frozenset[str]
    """Architectures that default to ``ModelRunnerV1`` here although V2 is the default."""
    collectives_capturable: bool = False
    """Whether the collectives of a parallel run (``distributed_backend``'s all-reduce and
    all-gather) are recorded into this platform's graphs and replayed with them. ``False`` (the
    default, always correct) makes each collective an eager break: at a parallel size above 1 the
    resolution downgrades FULL graphs, which have no eager break, to PIECEWISE. Claim ``True``
    only for a communicator whose work the graph backend records (NCCL under CUDA graphs)."""
    simulated: bool = False
    """True for ``simulate(platform)``: this policy on the CPU tape's device part."""

    def __init__(self) -> None:
        missing = [attr for attr in REQUIRED_ATTRIBUTES if not hasattr(self, attr)]
        if missing:
            raise TypeError(
                f"Can't instantiate abstract platform {type(self).__name__} without "
                f"{', '.join(missing)} (set each as a class attribute)"
            )

    @property
    def eager_region_reason(self) -> str:
        """Why the platform requires ``eager_region_strategy`` (recorded in resolutions)."""
        if self.eager_region_strategy == FullGraph():
            return f"platform {self.name} requires nothing beyond the graph mode"
        return f"platform {self.name} requires the {self.eager_region_strategy} region"

    @property
    def collectives_reason(self) -> str:
        """Whether and why collectives are captured into this platform's graphs (recorded in
        resolutions at a parallel size above 1): ``platform NAME can|cannot capture BACKEND
        collectives into a graph: WHY``. The default names the attribute, and says when it was
        left unset; built-in platforms give the device's reason instead."""
        declared = any(
            "collectives_capturable" in vars(cls)
            for cls in type(self).__mro__
            if cls is not Platform
        )
        can = "can" if self.collectives_capturable else "cannot"
        why = (
            f"it sets collectives_capturable = {self.collectives_capturable}"
            if declared
            else "it does not set collectives_capturable (the safe default)"
        )
        backend = self.distributed_backend
        return f"platform {self.name} {can} capture {backend} collectives into a graph: {why}"

    def v2_exclusion_reason(self, architecture: str) -> str:
        """Why ``architecture`` is excluded from the V2 default on this platform."""
        return f"platform {self.name} excludes {architecture} from the ModelRunnerV2 default"

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is false, in words a person can act on."""
        return f"no {self.device_type} device is usable by this build of torch"

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        """Why the device cannot compute a model in ``dtype`` (a device-part question: a
        simulated platform answers as the CPU does), or ``None`` when it can. The default
        answers ``None``: torch computes float32, bfloat16 and float16 on every device type."""
        return None

    # -- device part -------------------------------------------------------------------------------
    device_type: str
    """The torch device type tensors live on (ROCm builds of torch also report ``cuda``)."""
    distributed_backend: str = "gloo"
    """The ``torch.distributed`` backend parallel workers on this device initialise
    (``gloo``, which every torch build has and which serves CPU tensors, unless set)."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when this machine can run the platform's device and graph backend."""

    @abc.abstractmethod
    def create_memory_pool(self) -> Any:
        """Create a fresh memory pool (one per backend ``graph_backend`` hands out)."""

    @abc.abstractmethod
    def create_graph_backend(self, pool: Any) -> GraphBackend:
        """Create a graph backend that records into ``pool``."""

    def device_count(self) -> int | None:
        """Devices of this platform on this machine, for local ranks to take one each; ``None``
        where ranks share the device (the CPU: any number of processes). The default asks
        torch's module for ``device_type`` (``torch.cuda.device_count()``), 0 when unavailable."""
        if self.device_type == "cpu":
            return None
        if not self.is_available():
            return 0
        return int(torch.get_device_module(self.device_type).device_count())

    # -- what runs on the device part --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def graph_backend(self) -> GraphBackend:
        """A new graph backend for this platform, recording into a fresh memory pool."""
        self.require_available()
        return self.create_graph_backend(self.create_memory_pool())

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
