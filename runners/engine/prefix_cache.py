"""The prefix cache: a request whose leading tokens another request computed before continues
from where that computation ended, reading its blocks instead of computing them again.

What a continuation from position ``P`` reads (DESIGN §11) is a pure function of the tokens
before ``P``: the blocks of positions within the lookback of ``P`` (window KV, the compressors'
per-token state) and every entry block holding an entry completed before ``P``. So blocks are
found by the tokens that determine them:
- **Keys.** Token block ``i`` (positions ``i*B .. i*B+B-1``) is keyed by a hash chain over
  block-sized runs of token ids, ``h_i = sha256(h_{i-1} + tokens of block i)`` (``h_{-1}`` a
  constant), as vLLM keys its blocks: equal keys mean equal tokens from position 0 on, whatever
  came before. Entry block ``j`` is keyed by ``(h_{P/B-1}, j)``, ``P`` the first boundary at
  which it is complete.
- **Boundaries.** A hit ends at a multiple ``P`` of ``EngineLimits.prefix_boundary``: there every
  token block before ``P`` is complete, every entry block covering entries before ``P`` holds
  only entries completed before ``P``, and every position and entry the continuation writes
  lies in a block after them. So a shared block is never written again: sharing is read-only,
  by reference count, and needs no copy. A hit also leaves at least one token to compute, whose
  logits the request samples.
- **What is kept.** A complete token block is keyed only if a continuation from some boundary
  reads it (it lies within the lookback of the next boundary after it); blocks the engine
  releases past a request's lookback stay keyed (idle, evictable) only then, and the others are
  freed as without a cache. Entry blocks are keyed at each boundary a request passes.
- **Hits.** A request admitted (new, or resuming after preemption: it finds its own blocks) takes
  the longest boundary ``P`` whose entry blocks ``0 .. P/(B*entry_rate)-1`` and whose token
  blocks within the lookback of ``P`` are all cached; it then holds them like blocks it computed
  (released past the lookback, freed when it ends) and starts computing at ``P``.
- **Eviction** is the pools' (``BlockPool``): an unreferenced keyed block is idle, counted as
  free, and evicted least recently used first when blocks run out.

Everything here is host-side and deterministic (sha256 of the token ids, no process-seeded
hash), so every rank of a parallel run keeps the same cache and the same block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable

import attrs

from runners.engine.block_pool import BlockPool
from runners.engine.request import Request

__all__ = ["Hit", "PrefixCache", "PrefixCacheStats", "block_hash"]

_ROOT = hashlib.sha256(b"dsv4 prefix cache").digest()


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a block of ``tokens`` whose predecessor's key is ``parent``."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@attrs.frozen(kw_only=True)
class Hit:
    """A cached prefix a request can continue from."""

    num_tokens: int
    """``P``: the positions the request need not compute (a multiple of the boundary)."""
    released: int
    """Leading token blocks no query from ``P`` on reads (left out, as if released)."""
    block_ids: tuple[int, ...]
    """Token blocks ``released .. P/B-1``."""
    entry_block_ids: tuple[int, ...]
    """Entry blocks ``0 .. P/(B*entry_rate)-1``."""


@attrs.frozen(kw_only=True)
class PrefixCacheStats:
    """Counts since the engine started; a query is one admission of a request."""

    queries: int
    hits: int
    """Queries that found a cached prefix."""
    query_tokens: int
    """Tokens of the requests looked up (prompt, and output so far for a resumed one)."""
    hit_tokens: int
    """Tokens found cached: not computed."""
    cached_blocks: int
    """Token and entry blocks that carry a key now (held or idle)."""
    evicted_blocks: int
    """Idle keyed blocks handed out again (their keys dropped), so far."""


class PrefixCache:
    """Finds and keys the blocks of requests (module docstring); the scheduler owns both pools
    and the requests' block lists, and calls ``lookup``, ``take`` and ``record``."""

    def __init__(
        self,
        *,
        blocks: BlockPool,
        entry_blocks: BlockPool,
        block_size: int,
        entry_rate: int,
        boundary: int,
        lookback: int | None,
    ) -> None:
        """``boundary``: a multiple of ``block_size * entry_rate`` (``EngineLimits``)."""
        self.blocks = blocks
        self.entry_blocks = entry_blocks
        self.block_size = block_size
        self.boundary = boundary
        self.lookback = lookback
        self._entries_per_boundary = boundary // (block_size * entry_rate)
        self._queries = self._hits = self._query_tokens = self._hit_tokens = 0

    def lookup(self, request: Request) -> Hit | None:
        """The longest cached prefix of ``request``'s tokens that leaves one to compute."""
        last = (len(request.token_ids) - 1) // self.boundary
        hashes = self._hashes(request, last * self.boundary // self.block_size)
        entry_ids: list[int] = []
        for k in range(1, last + 1):
            found = self._entry_blocks_of(hashes, k)
            if found is None:
                break
            entry_ids += found
        for k in range(len(entry_ids) // self._entries_per_boundary, 0, -1):
            end = k * self.boundary
            first = self._first_read(end)
            token_ids = [self.blocks.find(h) for h in hashes[first : end // self.block_size]]
            if None not in token_ids:
                return Hit(
                    num_tokens=end,
                    released=first,
                    block_ids=tuple(i for i in token_ids if i is not None),
                    entry_block_ids=tuple(entry_ids[: k * self._entries_per_boundary]),
                )
        return None

    def cost(self, hit: Hit | None) -> tuple[int, int]:
        """Idle blocks and entry blocks taking ``hit`` removes from the pools' ``num_free``."""
        if hit is None:
            return 0, 0
        return (
            sum(self.blocks.is_idle(i) for i in hit.block_ids),
            sum(self.entry_blocks.is_idle(i) for i in hit.entry_block_ids),
        )

    def take(self, request: Request, hit: Hit | None) -> None:
        """Count one query of ``request``, and share ``hit``'s blocks with it."""
        self._queries += 1
        self._query_tokens += len(request.token_ids)
        request.recorded_to = 0
        if hit is None:
            return
        self._hits += 1
        self._hit_tokens += hit.num_tokens
        self.blocks.share(hit.block_ids)
        self.entry_blocks.share(hit.entry_block_ids)
        request.recorded_to = hit.num_tokens

    def record(self, request: Request) -> None:
        """Key the blocks ``request`` completed since its last ``record`` (call after its
        ``num_computed`` advanced, before it releases anything)."""
        done, size = request.num_computed, self.block_size
        hashes = self._hashes(request, done // size)
        for i in range(request.recorded_to // size, done // size):
            if i >= request.released and self._read_from_a_boundary(i):
                self.blocks.set_key(request.block_ids[i - request.released], hashes[i])
        per = self._entries_per_boundary
        for k in range(request.recorded_to // self.boundary + 1, done // self.boundary + 1):
            for j in range((k - 1) * per, k * per):
                key = self._entry_key(hashes, k, j)
                self.entry_blocks.set_key(request.entry_block_ids[j], key)
        request.recorded_to = done

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            queries=self._queries,
            hits=self._hits,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            cached_blocks=self.blocks.num_cached + self.entry_blocks.num_cached,
            evicted_blocks=self.blocks.num_evicted + self.entry_blocks.num_evicted,
        )

    def _hashes(self, request: Request, count: int) -> list[bytes]:
        """The keys of ``request``'s first ``count`` token blocks (extending its chain)."""
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) < count:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT
            hashes.append(block_hash(parent, request.token_ids[i * size : (i + 1) * size]))
        return hashes

    def _entry_key(self, hashes: list[bytes], k: int, j: int) -> Hashable:
        """Key of entry block ``j``, complete at boundary ``k``."""
        return (hashes[k * self.boundary // self.block_size - 1], j)

    def _entry_blocks_of(self, hashes: list[bytes], k: int) -> list[int] | None:
        """The cached entry blocks completed at boundary ``k``; None if one is missing."""
        per = self._entries_per_boundary
        keys = [self._entry_key(hashes, k, j) for j in range((k - 1) * per, k * per)]
        found = [self.entry_blocks.find(key) for key in keys]
        return None if None in found else [i for i in found if i is not None]

    def _first_read(self, end: int) -> int:
        """The first token block a query from ``end`` on may read."""
        if self.lookback is None:
            return 0
        return max(0, end - self.lookback + 1) // self.block_size

    def _read_from_a_boundary(self, block: int) -> bool:
        """Whether a continuation from the first boundary after ``block`` reads it."""
        end = (block + 1) * self.block_size
        after = -(-end // self.boundary) * self.boundary
        return self._first_read(after) <= block
