"""What each request holds of the two block pools, and the rules that grow and shrink it.

Blocks of two pools (``EngineLimits``) are allocated lazily, as a request's tokens grow, and never
reserved ahead: blocks of positions (the executor's window and compressor state) and entry
blocks (compressed entries, one slot per ``entry_rate`` tokens). "Blocks" below means both.
- Release: once every later query of a request is more than ``lookback - 1`` positions past a
  block's last position, no layer can read that block again, so it goes back to the pool while
  the request runs (after the step that moved the request past it; ``RELEASED_BLOCK`` stands in
  for it in the chunks). A request therefore holds at most ``ceil((lookback - 1 + budget) /
  block_size) + 1`` blocks of positions at once, however long it grows; entry blocks stay until
  it finishes, since attention may select any entry. Without a ``lookback`` (an executor that
  may read any earlier position) nothing is released.
- Prefix cache (``runners.engine.prefix_cache``, when the executor has a ``prefix_boundary`` and
  the engine enables it): a request admitted starts from the longest cached prefix of its
  tokens, holding those blocks (shared, read-only) as if it had computed them, and computing
  from the hit's end; the blocks it completes are keyed as it goes, and a released or freed
  block that is keyed stays cached, counted as free, until an allocation evicts it.

Invariants: ``(released + len(block_ids)) * block_size`` covers a running request's positions
fed so far and ``block_tuple`` is ``(RELEASED_BLOCK,) * released + block_ids``; its entry blocks
cover its complete entries; a block it writes into is held by it alone (the pools count every
holder's reference).
"""

from __future__ import annotations

from runners.engine.block_pool import BlockPool
from runners.engine.prefix_cache import Hit, PrefixCache
from runners.engine.request import Request

__all__ = ["RELEASED_BLOCK", "KVBlocks"]

RELEASED_BLOCK = 0
"""The id a chunk carries for a released block: any valid id does, since the executor never reads
a block all of whose positions left every layer's lookback (``runners.engine.executor``)."""


class KVBlocks:
    """The two pools, and the prefix cache over them when there is one (module docstring)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        num_entry_blocks: int,
        block_size: int,
        entry_rate: int,
        lookback: int | None,
        token_budget: int,
        prefix_boundary: int | None,
    ) -> None:
        self.block_size = block_size
        self.entry_rate = entry_rate
        self.lookback = lookback
        self.token_budget = token_budget
        self.blocks = BlockPool(num_blocks, what="KV block")
        self.entry_blocks = BlockPool(num_entry_blocks, what="entry block")
        self.prefix_cache = None
        if prefix_boundary is not None:
            self.prefix_cache = PrefixCache(
                blocks=self.blocks,
                entry_blocks=self.entry_blocks,
                block_size=block_size,
                entry_rate=entry_rate,
                boundary=prefix_boundary,
                lookback=lookback,
            )
        self.num_released = 0
        """Blocks given back by running requests so far (their positions left the lookback)."""

    def most_held(self, length: int) -> tuple[int, int]:
        """The most blocks and entry blocks a request of ``length`` cached tokens holds at once
        (see the module docstring)."""
        blocks = self._blocks_for(length)
        if self.lookback is not None:
            window = self._blocks_for(self.lookback - 1 + self.token_budget) + 1
            blocks = min(blocks, window)
        return blocks, self._entry_blocks_for(length)

    def lookup(self, request: Request) -> Hit | None:
        """The cached prefix waiting ``request`` would start from (None: none, or no cache)."""
        return None if self.prefix_cache is None else self.prefix_cache.lookup(request)

    def fits(self, request: Request, end: int, hit: Hit | None = None) -> bool:
        """Whether the free blocks cover ``request``'s positions ``0 .. end-1``, once it holds
        ``hit`` (whose idle blocks then no longer count as free)."""
        held = request.released + len(request.block_ids)
        entries_held = len(request.entry_block_ids)
        idle = (0, 0)
        if hit is not None and self.prefix_cache is not None:
            held, entries_held = hit.num_tokens // self.block_size, len(hit.entry_block_ids)
            idle = self.prefix_cache.cost(hit)
        blocks = max(0, self._blocks_for(end) - held) + idle[0]
        entries = max(0, self._entry_blocks_for(end) - entries_held) + idle[1]
        return blocks <= self.blocks.num_free and entries <= self.entry_blocks.num_free

    def start(self, request: Request, hit: Hit | None) -> None:
        """Admitted ``request`` starts from ``hit`` (counted as a query of the prefix cache): it
        holds the hit's blocks, those before its lookback released, and computes from its end."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.take(request, hit)
        if hit is not None:
            request.num_computed = hit.num_tokens
            request.released = hit.released
            request.block_ids = list(hit.block_ids)
            request.entry_block_ids = list(hit.entry_block_ids)
            request.entry_block_tuple = hit.entry_block_ids
            _retuple(request)

    def grow(self, request: Request, end: int) -> None:
        """Allocate the blocks ``request`` lacks to cover positions ``0 .. end-1`` (``fits``
        said they are free)."""
        blocks = self._blocks_for(end) - request.released - len(request.block_ids)
        entries = self._entry_blocks_for(end) - len(request.entry_block_ids)
        if blocks > 0:
            request.block_ids.extend(self.blocks.allocate(blocks))
            _retuple(request)
        if entries > 0:
            request.entry_block_ids.extend(self.entry_blocks.allocate(entries))
            request.entry_block_tuple = tuple(request.entry_block_ids)

    def advance(self, request: Request) -> None:
        """After ``request``'s ``num_computed`` grew: key the blocks it completed, then give back
        the leading ones no later query can read."""
        if self.prefix_cache is not None:
            self.prefix_cache.record(request)
        self.release_passed(request)

    def release_passed(self, request: Request) -> None:
        """Give back the leading blocks of ``request`` that no later query can read."""
        if self.lookback is None:
            return
        passed = max(0, request.num_computed - self.lookback + 1) // self.block_size
        count = passed - request.released
        if count > 0:
            self.blocks.free(request.block_ids[:count])
            del request.block_ids[:count]
            request.released = passed
            self.num_released += count
            _retuple(request)

    def release(self, request: Request) -> None:
        """Give back every block ``request`` holds (it finished or was preempted)."""
        self.blocks.free(request.block_ids)
        self.entry_blocks.free(request.entry_block_ids)
        request.block_ids = []
        request.released = 0
        request.block_tuple = ()
        request.entry_block_ids = []
        request.entry_block_tuple = ()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _entry_blocks_for(self, num_tokens: int) -> int:
        """Entry blocks covering the entries ``num_tokens`` tokens complete."""
        return self._blocks_for(num_tokens // self.entry_rate)


def _retuple(request: Request) -> None:
    """Rebuild the block list a chunk carries after blocks were added or released."""
    request.block_tuple = (RELEASED_BLOCK,) * request.released + tuple(request.block_ids)
