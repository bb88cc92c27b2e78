"""Memory of the tape: buffers for intermediates no one outside a segment can see, shared.

The tape replays every op into the tensors it captured, so a naive tape keeps every
intermediate of the forward alive: 2-5x the memory eager needs. Most intermediates, though, are
dropped by the program before its segment ends; nothing outside the tape can ever observe them.
Their storage is *internal*: at the end of a segment the tape re-homes every tensor over an
internal storage into one arena, at offsets chosen so that two storages share bytes only if
their lifetimes within the segment (first op that allocates to last op that touches them) are
disjoint.

Invariants:
- A storage is internal iff it was allocated inside the segment and no tensor anywhere still
  uses it when the segment ends (its weak reference has expired). Storages the program still
  holds (outputs, tensors passed to later segments or eager breaks) keep their own memory.
- Internal storages never outlive their segment, so all segments of one backend share one arena
  (the backend's ``pool``): segments never run concurrently, and replay recomputes every
  internal value before reading it. Replaying two captures of one backend at the same time from
  two threads is therefore not allowed.
- The arena grows to the largest segment's need; a segment planned against a smaller, older
  arena keeps that one alive.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
import torch

from graphs.backend import PoolGraphs

__all__ = ["ALIGNMENT", "Lifetime", "SegmentMemory", "TapePool", "plan_offsets"]

ALIGNMENT = 64
"""Byte alignment of every arena offset; a multiple of every dtype's size."""


@attrs.frozen(kw_only=True)
class Lifetime:
    """An internal storage: its size and the first and last op indices that touch it."""

    key: int
    nbytes: int
    first: int
    last: int


@attrs.frozen(kw_only=True)
class SegmentMemory:
    """What one tape segment holds, in bytes.

    ``arena_bytes``: the arena slice its internal intermediates use (shared with other
    segments); ``internal_bytes``: what those intermediates would take without sharing;
    ``retained_bytes``: storages allocated in the segment that the program still holds
    (outputs, values for later segments) — the tape keeps these alive; ``constant_bytes``:
    factory outputs and literals kept as constants, and copies of literals restored on replay.
    """

    arena_bytes: int
    internal_bytes: int
    retained_bytes: int
    constant_bytes: int


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


_SHORT = 64
"""Lifetimes spanning at most this many ops are indexed by first op; longer ones are few."""


def plan_offsets(blocks: Sequence[Lifetime]) -> tuple[dict[int, int], int]:
    """Byte offsets for ``blocks`` such that blocks with overlapping lifetimes never overlap.

    Greedy: largest blocks first, each at the lowest aligned offset that fits between blocks
    already placed whose lifetimes intersect its own. Returns (offset by key, total bytes).

    Finding those blocks is what costs: placed short lifetimes are kept sorted by first op, so
    only those starting within ``_SHORT`` ops before the block's first op up to its last are
    scanned; the few long ones are all scanned. The placement is the all-pairs one.
    """
    firsts: list[int] = []  # sorted first ops of placed short blocks
    short: list[tuple[int, int, int, int]] = []  # (first, last, start, end), same order
    long: list[tuple[int, int, int, int]] = []
    offsets: dict[int, int] = {}
    total = 0
    for block in sorted(blocks, key=lambda b: (-b.nbytes, b.first, b.key)):
        size = _aligned(block.nbytes)
        first, last = block.first, block.last
        window = short[
            bisect.bisect_left(firsts, first - _SHORT) : bisect.bisect_right(firsts, last)
        ]
        busy = sorted(
            [(start, end) for lo, hi, start, end in window if first <= hi]
            + [(start, end) for lo, hi, start, end in long if lo <= last and first <= hi]
        )
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            if end > offset:
                offset = end
        entry = (first, last, offset, offset + size)
        if last - first <= _SHORT:
            at = bisect.bisect_right(firsts, first)
            firsts.insert(at, first)
            short.insert(at, entry)
        else:
            long.append(entry)
        offsets[block.key] = offset
        if offset + size > total:
            total = offset + size
    return offsets, total


class TapePool:
    """The arena shared by every segment of one ``TapeBackend``, one per device."""

    def __init__(self) -> None:
        self._arenas: dict[torch.device, torch.UntypedStorage] = {}
        self.graphs = PoolGraphs()
        """The segments recorded into this pool (a retired pool is never recorded into)."""

    def arena(self, device: torch.device, nbytes: int) -> torch.UntypedStorage:
        """An arena of at least ``nbytes`` on ``device`` (the current one if large enough)."""
        current = self._arenas.get(device)
        if current is None or current.nbytes() < nbytes:
            current = torch.UntypedStorage(nbytes, device=device)
            self._arenas[device] = current
        return current

    @property
    def nbytes(self) -> int:
        """Bytes of the current arenas (older, smaller ones live on in old segments)."""
        return sum(a.nbytes() for a in self._arenas.values())

    def __repr__(self) -> str:
        return f"TapePool(nbytes={self.nbytes})"
