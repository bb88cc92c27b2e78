"""Free lists of KV-cache blocks (and of block-table rows, which behave the same way).

Invariants:
- Every id in ``0 .. size-1`` is either free or held by exactly one owner; ``free`` of an id that
  is already free is a bug in the caller and raises, so a double free can never hand one block
  to two requests.
- Freed ids are reused last-in first-out: a block freed by a finished request is the next one
  handed out, which makes any stale read of a reused block show up quickly in tests.
- ``allocate`` never hands out more than is free; the scheduler checks ``num_free`` before it
  asks (admitting, or preempting to make room: see ``scheduler``), so running out here is a bug,
  not back-pressure.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BlockPool"]


class BlockPool:
    """A pool of ``size`` interchangeable ids (KV blocks or block-table rows)."""

    def __init__(self, size: int, *, what: str = "KV block") -> None:
        if size < 1:
            raise ValueError(f"a pool of {what}s needs at least one, got {size}")
        self.size = size
        self.what = what
        self._free = list(range(size - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free ids (lowest first on a fresh pool, then most recently freed)."""
        if count > len(self._free):
            raise RuntimeError(
                f"asked for {count} {self.what}s with {len(self._free)} free (scheduler bug)"
            )
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        taken.reverse()
        for i in taken:
            self._is_free[i] = 0
        return taken

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool; each must be held (not already free)."""
        returned = list(ids)
        for i in returned:
            if self._is_free[i]:
                raise RuntimeError(f"{self.what} {i} freed twice")
            self._is_free[i] = 1
        self._free.extend(reversed(returned))
