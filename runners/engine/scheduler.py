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

Blocks of two pools are allocated as a request's tokens grow, released past its lookback, and
shared between requests by the prefix cache: ``runners.engine.kv_blocks``.
- Admission: the head of the queue is admitted when a block-table row is free and the blocks of
  its first chunk are free, after the prefix cache's hit (its chunk then starts where the hit
  ends, and the hit's cached blocks nobody held leave the free count). A head that does not fit
  waits (at the head, so smaller requests
  behind it cannot starve it). Admission thus guarantees the first chunk only, not the whole
  request: more requests run at once than a worst-case reservation would allow.
- Preemption: when a running request's chunk needs more blocks than are free, the newest running
  request (the last admitted; possibly the one asking) is preempted, and again until the chunk
  fits. Running requests are fed in admission order, so none preempted was fed in the step yet.
  A preempted request gives back its blocks and its row and goes to the front of the queue,
  so it resumes before any new request; it keeps its tokens (prompt and output so far) and its
  sampling generator, and on resumption all of its tokens are fed again as a prefill (recompute),
  from where the prefix cache's hit ends (its own blocks, if they were not evicted since).
  Logits are only sampled for a chunk that reaches a request's newest token, so a resumed request
  samples nothing until it has caught up, and the token it then samples is a new one: outputs
  (greedy or seeded) are those of a run without preemption, and no token counts twice.
- A step that preempted admits nothing: the pool is exhausted, and an admitted request would only
  be preempted again.

No deadlock, no livelock. A request is queued only if the most it holds of each pool at once
(``KVBlocks.most_held``) fits that pool, and it fits one row (``LLM.add_request`` refuses the
others with ``RequestTooLongError``), so a request alone in the engine always has the blocks it
needs (cached blocks nobody holds count as free). Hence the oldest running request is never
preempted:
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
from runners.engine.kv_blocks import RELEASED_BLOCK, KVBlocks
from runners.engine.request import FinishReason, Request, RequestOutput

__all__ = ["RELEASED_BLOCK", "ScheduledStep", "Scheduler"]


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
    a block's references are the running requests holding it, and the blocks held, with the free
    ones (cached or not), make up the pool.
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
        ``entry_rate``: tokens per entry slot; ``lookback``: see ``kv_blocks``;
        ``prefix_boundary``: where prefix-cache hits may end (``None``: no prefix cache)."""
        self.token_budget = token_budget
        self.kv = KVBlocks(
            num_blocks=num_blocks,
            num_entry_blocks=num_blocks if num_entry_blocks is None else num_entry_blocks,
            block_size=block_size,
            entry_rate=entry_rate,
            lookback=lookback,
            token_budget=token_budget,
            prefix_boundary=prefix_boundary,
        )
        self.block_size, self.entry_rate, self.lookback = block_size, entry_rate, lookback
        self.blocks, self.entry_blocks = self.kv.blocks, self.kv.entry_blocks
        self.prefix_cache = self.kv.prefix_cache
        self.rows = BlockPool(max_rows, what="block-table row")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}
        self.num_preemptions = 0
        """Preemptions so far (a request preempted twice counts twice)."""

    @property
    def num_released_blocks(self) -> int:
        """Blocks given back by running requests so far (their positions left the lookback)."""
        return self.kv.num_released

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
            hit = self.kv.lookup(request)
            start = 0 if hit is None else hit.num_tokens
            count = min(len(request.token_ids) - start, budget)
            if not self.kv.fits(request, start + count, hit):
                break
            self.waiting.popleft()
            request.row = self.rows.allocate(1)[0]
            self.running.append(request)
            self.kv.start(request, hit)
            self.kv.grow(request, start + count)
            budget -= self._feed(step, request, count)
        return step if step.chunks else None

    def commit(self, step: ScheduledStep, sampled: Sequence[int | str]) -> list[RequestOutput]:
        """Advance every request of ``step``; ``sampled[j]`` is the token of ``sample_rows[j]``, or
        the reason it could not be sampled (that request then finishes with an error)."""
        for chunk, request in zip(step.chunks, step.requests, strict=True):
            request.num_computed += chunk.num_tokens
            self.kv.advance(request)
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
        (``KVBlocks.most_held``)."""
        return self.kv.most_held(length)

    def _make_room(self, request: Request, end: int) -> bool:
        """Give running ``request`` the blocks covering positions ``0 .. end-1``, preempting the
        newest running requests while too few are free; False if ``request`` itself (then the
        newest) had to be preempted."""
        while not self.kv.fits(request, end):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        self.kv.grow(request, end)
        return True

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
        self.kv.release(request)
        self.rows.free([request.row])
        request.row = None
