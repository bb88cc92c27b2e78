"""Continuous batching with chunked prefill under a token budget, admission by what is needed now,
and preemption by recompute when the KV blocks run out.

Each step is built in this order, until the token budget is spent:
1. running requests, oldest first (admission order), each feed what they have pending: one token
   for a request past its prefill, else its next prompt chunk (as much as the budget allows);
2. unless step 1 preempted a request, waiting requests are admitted first-in first-out and feed
   their first prompt chunk.
Requests still in their prefill form a suffix of the running list (a request is fed only once
every older one has fed all it had pending, admission appends, and finishing or preemption only
removes), so step 1 feeds every decode before any prefill: a long prefill never stalls
generation.

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
- Admission: the head of the queue is admitted when a block-table row is free and the blocks of
  its first chunk are free. A head that does not fit waits (at the head, so smaller requests
  behind it cannot starve it). Admission thus guarantees the first chunk only, not the whole
  request: more requests run at once than a worst-case reservation would allow.
- Preemption: when a running request's chunk needs more blocks than are free, the newest running
  request (the last admitted; possibly the one asking) is preempted, and again until the chunk
  fits. Running requests are fed in admission order, so none preempted was fed in the step yet.
  A preempted request gives back its blocks and its row and goes to the front of the queue,
  so it resumes before any new request; it keeps its tokens (prompt and output so far) and its
  sampling generator, and on resumption all of its tokens are fed again as a prefill (recompute).
  Logits are only sampled for a chunk that reaches a request's newest token, so a resumed request
  samples nothing until it has caught up, and the token it then samples is a new one: outputs
  (greedy or seeded) are those of a run without preemption, and no token counts twice.
- A step that preempted admits nothing: the pool is exhausted, and an admitted request would only
  be preempted again.

No deadlock, no livelock. A request is queued only if the most it holds of each pool at once
(``Scheduler.most_held``) fits that pool, and it fits one row (``LLM.add_request`` refuses the
others with ``RequestTooLongError``), so a request alone in the engine always has the blocks it
needs. Hence the oldest running request is never preempted:
it is fed first, and preempting every newer one would leave it alone. It is fed at least one token
every step (the budget is at least one), so it finishes; then the next oldest is the oldest. An
engine with no running request admits its queue's head (every block and row is free), and the
queue is first-in first-out, so every queued request is eventually admitted and finishes.

A failed step (the executor raises, or its logits are malformed) advances no request: ``schedule``
may have allocated blocks, admitted requests and preempted others, and all of that stays, but
every admitted request's ``num_computed`` is unchanged, so the next step feeds the same positions
through the same blocks (a preempted one restarts from position 0 later, as it would have).
``commit`` advances requests only once their logits were sampled, and finishes a request whose
logits could not be sampled with ``FinishReason.ERROR``, freeing its blocks and row at once like
any other finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from runners.engine.block_pool import BlockPool
from runners.engine.executor import ScheduledChunk
from runners.engine.prefix_cache import Hit, PrefixCache
from runners.engine.request import FinishReason, Request, RequestOutput

__all__ = ["RELEASED_BLOCK", "ScheduledStep", "Scheduler"]

RELEASED_BLOCK = 0
"""The id a chunk carries for a released block: any valid id does, since the executor never reads
a block all of whose positions left every layer's lookback (``runners.engine.executor``)."""


@attrs.frozen(kw_only=True)
class ScheduledStep:
    """One step's work: chunk ``i`` feeds ``token_ids[i]`` of ``requests[i]``."""

    chunks: list[ScheduledChunk]
    token_ids: list[list[int]]
    requests: list[Request]
    sample_rows: list[int]
    """Indices of the chunks that reach their request's newest token: only their logits are used."""

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    """Queues, running set, rows and blocks of the live requests (see the module docstring).

    Invariants between calls: ``running`` is in admission order and holds exactly the live
    requests with a row; every other live request is in ``waiting`` and holds no row and no block;
    the blocks of the running requests are disjoint and, with the free ones, make up the pool.
    """

    def __init__(
        self,
        *,
        max_rows: int,
        num_blocks: int,
        block_size: int,
        token_budget: int,
        num_entry_blocks: int | None = None,
        entry_rate: int = 1,
        lookback: int | None = None,
        prefix_boundary: int | None = None,
    ) -> None:
        """``num_entry_blocks``: the entry pool (default: as many as ``num_blocks``);
        ``entry_rate``: tokens per entry slot; ``lookback``: see the module docstring;
        ``prefix_boundary``: where prefix-cache hits may end (``None``: no prefix cache)."""
        self.block_size = block_size
        self.token_budget = token_budget
        self.entry_rate = entry_rate
        self.lookback = lookback
        self.blocks = BlockPool(num_blocks, what="KV block")
        self.entry_blocks = BlockPool(
            num_blocks if num_entry_blocks is None else num_entry_blocks, what="entry block"
        )
        self.rows = BlockPool(max_rows, what="block-table row")
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
        self.num_released_blocks = 0
        """Blocks given back by running requests so far (their positions left the lookback)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}
        self.num_preemptions = 0
        """Preemptions so far (a request preempted twice counts twice)."""

    def add(self, request: Request) -> None:
        """Queue a validated request whose id is not live."""
        self.live[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> ScheduledStep | None:
        """Build the next step (None when no request is live)."""
        step = ScheduledStep(chunks=[], token_ids=[], requests=[], sample_rows=[])
        budget = self.token_budget
        preemptions = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(len(request.token_ids) - request.num_computed, budget)
            if self._make_room(request, request.num_computed + count):
                budget -= self._feed(step, request, count)
                index += 1
        if self.num_preemptions != preemptions:
            return step if step.chunks else None
        while budget > 0 and self.waiting and self.rows.num_free > 0:
            request = self.waiting[0]
            hit = self.prefix_cache.lookup(request) if self.prefix_cache is not None else None
            start = 0 if hit is None else hit.num_tokens
            count = min(len(request.token_ids) - start, budget)
            if not self._fits_admitted(request, hit, start + count):
                break
            self.waiting.popleft()
            request.row = self.rows.allocate(1)[0]
            self.running.append(request)
            self._take(request, hit)
            self._grow(request, start + count)
            budget -= self._feed(step, request, count)
        return step if step.chunks else None

    def commit(self, step: ScheduledStep, sampled: Sequence[int | str]) -> list[RequestOutput]:
        """Advance every request of ``step``; ``sampled[j]`` is the token of ``sample_rows[j]``, or
        the reason it could not be sampled (that request then finishes with an error)."""
        for chunk, request in zip(step.chunks, step.requests, strict=True):
            request.num_computed += chunk.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.record(request)
            self._release_passed(request)
        finished: list[RequestOutput] = []
        requests = step.requests
        for index, token in zip(step.sample_rows, sampled, strict=True):
            request = requests[index]
            if isinstance(token, str):
                error = f"request {request.request_id!r} failed: {token}"
                finished.append(self._finish(request, FinishReason.ERROR, error))
                continue
            stop_string = request.take_token(token)
            past_min = request.num_output > request.params.min_tokens
            if stop_string or (token in request.stop_ids and past_min):
                finished.append(self._finish(request, FinishReason.STOP))
            elif len(request.token_ids) >= request.max_len:
                finished.append(self._finish(request, FinishReason.LENGTH))
        if finished:
            self.running = [r for r in self.running if r.request_id in self.live]
        return finished

    def abort(self, request_id: str) -> RequestOutput | None:
        """Remove a live request now (None if no live request has this id)."""
        request = self.live.get(request_id)
        if request is None:
            return None
        if request.row is None:
            self.waiting.remove(request)
            del self.live[request_id]
            return request.output(FinishReason.ABORT)
        self.running.remove(request)
        return self._finish(request, FinishReason.ABORT)

    def most_held(self, length: int) -> tuple[int, int]:
        """The most blocks and entry blocks a request of ``length`` cached tokens holds at once
        (see the module docstring)."""
        blocks = self._blocks_for(length)
        if self.lookback is not None:
            window = self._blocks_for(self.lookback - 1 + self.token_budget) + 1
            blocks = min(blocks, window)
        return blocks, self._entry_blocks_for(length)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _entry_blocks_for(self, num_tokens: int) -> int:
        """Entry blocks covering the entries ``num_tokens`` tokens complete."""
        return self._blocks_for(num_tokens // self.entry_rate)

    def _lacking(self, request: Request, end: int) -> tuple[int, int]:
        """Blocks and entry blocks ``request`` lacks to cover positions ``0 .. end-1``."""
        held = request.released + len(request.block_ids)
        return (
            max(0, self._blocks_for(end) - held),
            max(0, self._entry_blocks_for(end) - len(request.entry_block_ids)),
        )

    def _fits(self, request: Request, end: int) -> bool:
        blocks, entries = self._lacking(request, end)
        return blocks <= self.blocks.num_free and entries <= self.entry_blocks.num_free

    def _fits_admitted(self, request: Request, hit: Hit | None, end: int) -> bool:
        """Whether waiting ``request`` fits positions ``0 .. end-1`` after taking ``hit``: the
        blocks it lacks beyond the hit, and the hit's idle blocks (taken off the free count)."""
        if self.prefix_cache is None or hit is None:
            return self._fits(request, end)
        idle_blocks, idle_entries = self.prefix_cache.cost(hit)
        blocks = self._blocks_for(end) - hit.num_tokens // self.block_size + idle_blocks
        entries = self._entry_blocks_for(end) - len(hit.entry_block_ids) + idle_entries
        return blocks <= self.blocks.num_free and entries <= self.entry_blocks.num_free

    def _take(self, request: Request, hit: Hit | None) -> None:
        """Start admitted ``request`` from ``hit``: it holds the hit's blocks as if it had
        computed them (the ones before its lookback released) and computes from its end."""
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

    def _make_room(self, request: Request, end: int) -> bool:
        """Give running ``request`` the blocks covering positions ``0 .. end-1``, preempting the
        newest running requests while too few are free; False if ``request`` itself (then the
        newest) had to be preempted."""
        while not self._fits(request, end):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        self._grow(request, end)
        return True

    def _grow(self, request: Request, end: int) -> None:
        """Allocate the blocks ``request`` lacks to cover positions ``0 .. end-1`` (the caller
        checked they are free)."""
        blocks, entries = self._lacking(request, end)
        if blocks > 0:
            request.block_ids.extend(self.blocks.allocate(blocks))
            _retuple(request)
        if entries > 0:
            request.entry_block_ids.extend(self.entry_blocks.allocate(entries))
            request.entry_block_tuple = tuple(request.entry_block_ids)

    def _release_passed(self, request: Request) -> None:
        """Give back the leading blocks of ``request`` that no later query can read."""
        if self.lookback is None:
            return
        passed = max(0, request.num_computed - self.lookback + 1) // self.block_size
        count = passed - request.released
        if count > 0:
            self.blocks.free(request.block_ids[:count])
            del request.block_ids[:count]
            request.released = passed
            self.num_released_blocks += count
            _retuple(request)

    def _feed(self, step: ScheduledStep, request: Request, count: int) -> int:
        """Add ``request``'s next ``count`` tokens to ``step`` (its blocks cover them)."""
        start = request.num_computed
        end = start + count
        assert request.row is not None
        if end == len(request.token_ids):
            step.sample_rows.append(len(step.chunks))
        step.chunks.append(
            ScheduledChunk(
                row=request.row,
                block_ids=request.block_tuple,
                start_position=start,
                num_tokens=count,
                entry_block_ids=request.entry_block_tuple,
            )
        )
        step.token_ids.append(request.token_ids[start:end])
        step.requests.append(request)
        return count

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and row (it is no longer in ``running``) and queue it
        first, to be recomputed from its tokens."""
        self._release(request)
        request.num_computed = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _finish(
        self, request: Request, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        self._release(request)
        del self.live[request.request_id]
        return request.output(reason, error)

    def _release(self, request: Request) -> None:
        assert request.row is not None
        self.blocks.free(request.block_ids)
        self.entry_blocks.free(request.entry_block_ids)
        self.rows.free([request.row])
        request.block_ids = []
        request.released = 0
        request.block_tuple = ()
        request.entry_block_ids = []
        request.entry_block_tuple = ()
        request.row = None


def _retuple(request: Request) -> None:
    """Rebuild the block list a chunk carries after blocks were added or released."""
    request.block_tuple = (RELEASED_BLOCK,) * request.released + tuple(request.block_ids)
