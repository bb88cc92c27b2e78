"""Pools of KV-cache blocks (and of block-table rows, which behave the same way), reference
counted, whose freed blocks may stay findable by a key until they are needed again.

Every id in ``0 .. size-1`` is in exactly one of three states:
- **held**: one or more references (``refs(i) >= 1``); a block held by several requests is shared
  read-only (the prefix cache: ``runners.engine.prefix_cache``);
- **idle**: no reference, but a key (the hash of what it holds): still findable by ``find``, and
  allocatable — allocation evicts idle blocks least recently used first, dropping their keys;
- **free**: no reference and no key.

Invariants:
- ``num_free`` counts idle and free ids alike: a cached block nobody holds never reduces what the
  scheduler may allocate (admission and preemption see the same pool as without a cache).
- ``free`` drops one reference; dropping one an id does not have is a bug in the caller and
  raises, so a double free can never hand one block to two requests.
- Free ids are reused last-in first-out, before any idle one is evicted: a block freed by a
  finished request is the next one handed out (a stale read of a reused block shows up quickly
  in tests), and a cached block is given up only when nothing else is left.
- A key names at most one id and an id carries at most one key; eviction removes both sides.
- ``allocate`` never hands out more than ``num_free``; the scheduler checks first (admitting, or
  preempting to make room: see ``scheduler``), so running out here is a bug, not back-pressure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

__all__ = ["BlockPool"]


class BlockPool:
    """A pool of ``size`` interchangeable ids (KV blocks, entry blocks or block-table rows)."""

    def __init__(self, size: int, *, what: str = "KV block") -> None:
        if size < 1:
            raise ValueError(f"a pool of {what}s needs at least one, got {size}")
        self.size = size
        self.what = what
        self._free = list(range(size - 1, -1, -1))
        self._refs = [0] * size
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Unreferenced ids with a key, least recently used first."""
        self._key_of: dict[int, Hashable] = {}
        self._id_of: dict[Hashable, int] = {}
        self.num_evicted = 0
        """Idle ids whose key was dropped to hand them out again, so far."""

    @property
    def num_free(self) -> int:
        """Ids ``allocate`` may hand out now: free and idle ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Ids that carry a key, held or idle."""
        return len(self._key_of)

    def free_ids(self) -> tuple[int, ...]:
        """The ids that are free (neither held nor keyed): their contents mean nothing."""
        return tuple(self._free)

    def refs(self, block: int) -> int:
        """References to ``block`` (0 when idle or free)."""
        return self._refs[block]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` ids, one reference each: free ones first (lowest first on a fresh pool,
        then most recently freed), then idle ones, least recently used first, evicted."""
        if count > self.num_free:
            raise RuntimeError(
                f"asked for {count} {self.what}s with {self.num_free} free (scheduler bug)"
            )
        from_free = min(count, len(self._free))
        taken = self._free[len(self._free) - from_free :]
        del self._free[len(self._free) - from_free :]
        taken.reverse()
        for _ in range(count - from_free):
            block, _ = self._idle.popitem(last=False)
            del self._id_of[self._key_of.pop(block)]
            self.num_evicted += 1
            taken.append(block)
        for i in taken:
            self._refs[i] = 1
        return taken

    def share(self, ids: Iterable[int]) -> None:
        """Add one reference to each id, held or idle (an idle one stops being evictable)."""
        for i in ids:
            if self._refs[i] == 0:
                if i not in self._idle:
                    raise RuntimeError(f"{self.what} {i} is free: nothing to share")
                del self._idle[i]
            self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference from each id; one left unreferenced turns idle (most recently
        used) if it has a key, else free. Of the ids one call leaves idle, the last is evicted
        first: a request's later blocks are less likely to be shared than its first ones."""
        returned = list(ids)
        for i in returned:
            if self._refs[i] == 0:
                raise RuntimeError(f"{self.what} {i} freed twice")
            self._refs[i] -= 1
        unheld = [i for i in returned if self._refs[i] == 0]
        for i in reversed(unheld):
            if i in self._key_of:
                self._idle[i] = None
        self._free.extend(i for i in reversed(unheld) if i not in self._key_of)

    def find(self, key: Hashable) -> int | None:
        """The id holding ``key``, held or idle; None if no id does."""
        return self._id_of.get(key)

    def is_idle(self, block: int) -> bool:
        """Whether ``block`` is unreferenced but keyed (sharing it takes it off ``num_free``)."""
        return block in self._idle

    def set_key(self, block: int, key: Hashable) -> bool:
        """Give held ``block`` the ``key`` of its contents; return whether it took it. A block
        that has a key keeps it; a key held by another held block stays there; a key on an idle
        block moves to ``block`` (the same contents, computed again), and the idle copy is
        freed, so the copy a request holds is the one that survives eviction."""
        if self._refs[block] == 0:
            raise RuntimeError(f"{self.what} {block} is not held: only a held block gets a key")
        other = self._id_of.get(key)
        if block in self._key_of or (other is not None and self._refs[other] > 0):
            return False
        if other is not None:
            del self._idle[other], self._key_of[other]
            self._free.append(other)
        self._key_of[block] = key
        self._id_of[key] = block
        return True
