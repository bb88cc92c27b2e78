"""``CpuPlatform``: the CPU, captured with the op tape.

The tape reproduces CUDA-graph semantics (fixed tensor identities, frozen host decisions), so the
CPU requires no eager region of its own and excludes nothing from the V2 default; it is always
available. ``simulate`` reuses ``tape_memory_pool`` and ``tape_backend`` to run any platform's
policy here.
"""

from __future__ import annotations

from typing import Any

from graphs.backend import GraphBackend
from graphs.strategies import EagerRegionStrategy, FullGraph
from platforms.base import Platform

__all__ = ["CpuPlatform", "tape_backend", "tape_memory_pool"]


def tape_memory_pool() -> Any:
    """A fresh tape arena pool (shared by every capture of one backend)."""
    from graphs.tape import TapePool

    return TapePool()


def tape_backend(pool: Any) -> GraphBackend:
    """The CPU op-tape backend recording into ``pool`` (imported lazily)."""
    from graphs.tape import TapeBackend

    return TapeBackend(pool=pool)


class CpuPlatform(Platform):
    """The CPU with the op-tape graph backend; always available."""

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def device_type(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return True

    @property
    def eager_region_strategy(self) -> EagerRegionStrategy:
        return FullGraph()

    @property
    def eager_region_reason(self) -> str:
        return "platform cpu requires nothing: the op tape replays against fixed tensors"

    @property
    def v2_excluded_architectures(self) -> frozenset[str]:
        return frozenset()

    def create_memory_pool(self) -> Any:
        return tape_memory_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return tape_backend(pool)
