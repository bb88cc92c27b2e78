"""``simulate(platform)``: a platform's policy on the CPU tape's device part.

A platform is policy plus a device part (see ``platforms.base``). A ``SimulatedPlatform`` brings
the CPU tape's device part — the ``cpu`` device type, always available, a tape pool, the tape
backend and ``gloo`` for parallel workers — and reads every other attribute through to the
platform it wraps: its name, required eager region, V2 exclusions, whether its collectives can be
captured, each reason hook, and any hook a subclass or a later ``Platform`` adds, with no change
here. So a ROCm or out-of-tree policy can be exercised, and its resolution proven correct, on a
machine without that device.

Collectives are the one place where the policy and the run part ways: ``collectives_capturable``
(and its reason) is the wrapped platform's, so a simulated CUDA resolves as CUDA does (no FULL
downgrade at a parallel size above 1), but the tape cannot capture a real ``gloo`` collective, so
a simulated run breaks around every one (``Resolution.collectives_in_graph`` is false).

Invariants:
- ``simulate`` is idempotent: a simulated platform simulated again wraps the same platform.
- A simulated platform equals one simulating an equal platform, never the platform itself.
"""

from __future__ import annotations

from typing import Any

from platforms.base import Platform
from platforms.cpu import CpuPlatform

__all__ = ["SimulatedPlatform", "simulate"]


class SimulatedPlatform(Platform):
    """``platform``'s policy on the CPU tape: this class body is the device part (with the base's
    members that run on it); every other attribute is read through to ``platform``."""

    simulated = True
    device_type = "cpu"
    distributed_backend = CpuPlatform.distributed_backend

    def __init__(self, platform: Platform) -> None:
        inner = platform.platform if isinstance(platform, SimulatedPlatform) else platform
        self.platform: Platform = inner
        super().__init__()

    is_available = CpuPlatform.is_available
    create_memory_pool = CpuPlatform.create_memory_pool
    create_graph_backend = CpuPlatform.create_graph_backend
    device = Platform.device
    device_count = Platform.device_count
    graph_backend = Platform.graph_backend
    require_available = Platform.require_available
    unsupported_dtype_reason = Platform.unsupported_dtype_reason

    def __getattribute__(self, attr: str) -> Any:
        if attr == "platform" or attr.startswith("__") or attr in vars(SimulatedPlatform):
            return object.__getattribute__(self, attr)
        return getattr(object.__getattribute__(self, "platform"), attr)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimulatedPlatform) and self.platform == other.platform

    def __hash__(self) -> int:
        return hash(("simulate", self.platform))

    def __repr__(self) -> str:
        return f"simulate({self.platform!r})"


def simulate(platform: Platform) -> SimulatedPlatform:
    """Run ``platform``'s policy on the CPU with the tape backend (idempotent)."""
    return SimulatedPlatform(platform)
