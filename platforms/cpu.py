"""``CpuPlatform``: the CPU, captured with the op tape.

The tape reproduces CUDA-graph semantics (fixed tensor identities, frozen host decisions), so the
CPU requires no eager region of its own and excludes nothing from the V2 default; it is always
available. ``simulate`` reuses ``tape_memory_pool`` and ``tape_backend`` to run any platform's
policy here.
"""

from __future__ import annotations

from typing import Any

from graphs.backend import GraphBackend
from graphs.strategies import FullGraph
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

    name = "cpu"
    device_type = "cpu"
    eager_region_strategy = FullGraph()
    eager_region_reason = "platform cpu requires nothing: the op tape replays against fixed tensors"
    v2_excluded_architectures: frozenset[str] = frozenset()

    def is_available(self) -> bool:
        return True

    def create_memory_pool(self) -> Any:
        return tape_memory_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return tape_backend(pool)
