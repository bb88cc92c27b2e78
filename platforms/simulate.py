"""``simulate(platform)``: a platform's policy run on the CPU with the op tape.

The simulated platform answers every policy question (name, required eager region, V2
exclusions, reasons) exactly as the platform it wraps, but its tensors live on the CPU and its
captures are recorded by the tape, so a ROCm or out-of-tree policy can be exercised — and its
resolution proven correct — on a machine without that device.
"""

from __future__ import annotations

from typing import Any

from graphs.backend import GraphBackend
from graphs.strategies import EagerRegionStrategy
from platforms.base import Platform
from platforms.cpu import tape_backend, tape_memory_pool

__all__ = ["SimulatedPlatform", "simulate"]


class SimulatedPlatform(Platform):
    """The policy of ``platform`` with the CPU's device, availability, pool and backend."""

    simulated = True

    def __init__(self, platform: Platform) -> None:
        inner = platform.platform if isinstance(platform, SimulatedPlatform) else platform
        self.platform: Platform = inner

    @property
    def name(self) -> str:
        return self.platform.name

    @property
    def device_type(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return True

    @property
    def eager_region_strategy(self) -> EagerRegionStrategy:
        return self.platform.eager_region_strategy

    @property
    def eager_region_reason(self) -> str:
        return self.platform.eager_region_reason

    @property
    def v2_excluded_architectures(self) -> frozenset[str]:
        return self.platform.v2_excluded_architectures

    def v2_exclusion_reason(self, architecture: str) -> str:
        return self.platform.v2_exclusion_reason(architecture)

    def create_memory_pool(self) -> Any:
        return tape_memory_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return tape_backend(pool)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimulatedPlatform) and self.platform == other.platform

    def __hash__(self) -> int:
        return hash(("simulate", self.platform))

    def __repr__(self) -> str:
        return f"simulate({self.platform!r})"


def simulate(platform: Platform) -> SimulatedPlatform:
    """Run ``platform``'s policy on the CPU with the tape backend (idempotent)."""
    return SimulatedPlatform(platform)
