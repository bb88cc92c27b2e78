"""``CpuPlatform``: the CPU, captured with the op tape.

The tape reproduces CUDA-graph semantics (fixed tensor identities, frozen host decisions), so the
CPU requires no eager region of its own and excludes nothing from the V2 default; it is always
available. Parallel workers talk over ``gloo``, which the tape cannot capture: gloo communicates
from its own host threads, outside the ATen ops the tape records, so every collective is an eager
break (and FULL graphs are downgraded at a parallel size above 1). ``simulate`` reuses its device
part, ``gloo`` included, to run any platform's policy here.
"""

from __future__ import annotations

from graphs.backend import GraphBackend
from graphs.strategies import FullGraph
from graphs.tape import TapeBackend, TapePool
from platforms.base import Platform

__all__ = ["CpuPlatform", "tape_backend", "tape_memory_pool"]


def tape_memory_pool() -> TapePool:
    """A fresh tape arena pool (shared by every capture of one backend)."""
    return TapePool()


def tape_backend(pool: TapePool) -> GraphBackend:
    """The CPU op-tape backend recording into ``pool``."""
    return TapeBackend(pool=pool)


class CpuPlatform(Platform):
    """The CPU with the op-tape graph backend; always available.

    Its device part (``is_available``, the two factories, typed for any ``Platform``, and
    ``distributed_backend``) is ``SimulatedPlatform``'s too."""

    name = "cpu"
    device_type = "cpu"
    eager_region_strategy = FullGraph()
    eager_region_reason = "platform cpu requires nothing: the op tape replays against fixed tensors"
    v2_excluded_architectures: frozenset[str] = frozenset()
    collectives_capturable = False
    distributed_backend = "gloo"

    @property
    def collectives_reason(self) -> str:
        return (
            f"platform {self.name} cannot capture gloo collectives into a graph: gloo "
            "communicates from its own host threads, outside the ops the tape records"
        )

    def is_available(self: Platform) -> bool:
        return True

    def create_memory_pool(self: Platform) -> TapePool:
        return tape_memory_pool()

    def create_graph_backend(self: Platform, pool: TapePool) -> GraphBackend:
        return tape_backend(pool)
