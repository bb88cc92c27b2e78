"""Eager regions: which part of an attention layer runs eagerly under graph capture.

Each region is an ``EagerRegionStrategy``; the four form a chain ordered by how much of the layer
runs eagerly::

    FullGraph  <  NarrowRegion  <  WideRegion  <  NoGraph

Invariants:
- Wider is always safe, narrower is faster. ``a.join(b)`` is the wider of the two, so joining the
  requirements of a platform, a model runner and a graph mode yields the narrowest region that
  satisfies all three.
- A region is a value: instances of one class are equal and hash alike, and each has a stable
  ``name`` (``full-graph``, ``narrow``, ``wide``, ``no-graph``) used by the CLI and in reasons.
- ``compose(prepare, attend)`` is the only way an attention layer turns its two private steps into
  the callable its ``forward`` calls; every region computes ``attend(prepare(*args))`` and they
  differ only in where eager breaks are placed, so outside a capture all four are the same
  function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from graphs.capture import eager_break_during_capture

__all__ = [
    "STRATEGIES",
    "EagerRegionStrategy",
    "FullGraph",
    "NarrowRegion",
    "NoGraph",
    "WideRegion",
    "strategy_from_name",
]

R = TypeVar("R")
Prepared = Any


@functools.total_ordering
class EagerRegionStrategy:
    """Base of the four regions; subclasses fix ``name``, ``rank`` and where the breaks fall.

    Ordered by ``rank`` (``<``; the other comparisons follow from it and ``==``)."""

    name: ClassVar[str]
    rank: ClassVar[int]
    attend_breaks: ClassVar[bool] = False
    """The attention core (*attend*) alone is an eager break; preparation is captured."""
    region_breaks: ClassVar[bool] = False
    """Preparation and attention core together are one eager break."""

    def join(self, other: EagerRegionStrategy) -> EagerRegionStrategy:
        """The wider of ``self`` and ``other`` (the least upper bound on the chain)."""
        return self if self.rank >= other.rank else other

    def covers(self, required: EagerRegionStrategy) -> bool:
        """True when this region is at least as wide as ``required`` (so it is safe for it)."""
        return self.rank >= required.rank

    def compose(
        self, prepare: Callable[..., Prepared], attend: Callable[[Prepared], R]
    ) -> Callable[..., R]:
        """Return the callable that runs ``attend(prepare(*args, **kwargs))`` with breaks placed."""
        if self.attend_breaks:
            attend = eager_break_during_capture(attend)

        def region(*args: Any, **kwargs: Any) -> R:
            return attend(prepare(*args, **kwargs))

        return eager_break_during_capture(region) if self.region_breaks else region

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(self.name)

    def __lt__(self, other: EagerRegionStrategy) -> bool:
        return self.rank < other.rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __str__(self) -> str:
        return self.name


class FullGraph(EagerRegionStrategy):
    """Nothing eager: prepare and attend are both captured (FULL capture)."""

    name = "full-graph"
    rank = 0


class NarrowRegion(EagerRegionStrategy):
    """Only the attention core (*attend*) is an eager break; input preparation is captured."""

    name = "narrow"
    rank = 1
    attend_breaks = True


class WideRegion(EagerRegionStrategy):
    """Input preparation and attention core together are one eager break."""

    name = "wide"
    rank = 2
    region_breaks = True


class NoGraph(WideRegion):
    """Nothing is captured; the region composes like ``WideRegion`` so it stays safe if captured."""

    name = "no-graph"
    rank = 3


STRATEGIES: tuple[EagerRegionStrategy, ...] = (FullGraph(), NarrowRegion(), WideRegion(), NoGraph())


def strategy_from_name(name: str) -> EagerRegionStrategy:
    """Look a region up by its stable name; raise ``ValueError`` listing the valid names."""
    for region in STRATEGIES:
        if region.name == name:
            return region
    valid = ", ".join(r.name for r in STRATEGIES)
    raise ValueError(f"unknown eager region {name!r}; expected one of: {valid}")
