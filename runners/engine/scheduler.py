"""Continuous batching with chunked prefill under a token budget, and KV block bookkeeping.

Each step is built in this order, until the token budget is spent:
1. every running request past its prompt feeds its one pending token (decodes first, so a long
   prefill never stalls generation);
2. running requests still in their prompt feed their next chunk (as much as the budget allows);
3. waiting requests are admitted first-in first-out and feed their first prompt chunk.

Admission control, the invariant that makes running out of blocks safe: a request is admitted only
if a block-table row is free and ``committed + request.max_blocks <= num_blocks``, where
``committed`` sums the worst-case blocks of every admitted request. Blocks are still allocated
lazily, as a request's tokens grow, but a running request's allocation can never fail, so nothing
is ever preempted or recomputed and a running request's output does not depend on the others.
A request that does not fit yet waits (at the head of the queue, so it is not starved by smaller
ones) until finishing requests free their share; one that could never fit is refused before it is
queued (``LLM.add_request``). Since any running request progresses every step while the budget
lasts, and an empty engine always admits its queue's head, the engine cannot deadlock.

``schedule`` changes nothing a failed step would have to undo except by allocating blocks within a
request's reservation (admitted requests stay admitted and the next step feeds the same positions
through the same blocks); ``commit`` advances requests only once their logits were sampled, and
finishes a request whose logits could not be sampled with ``FinishReason.ERROR``, freeing its
blocks and row at once like any other finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from runners.engine.block_pool import BlockPool
from runners.engine.executor import ScheduledChunk
from runners.engine.request import FinishReason, Request, RequestOutput

__all__ = ["ScheduledStep", "Scheduler"]


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
    """Queues, running set, rows and blocks of the live requests (see the module docstring)."""

    def __init__(
        self, *, max_rows: int, num_blocks: int, block_size: int, token_budget: int
    ) -> None:
        self.block_size = block_size
        self.token_budget = token_budget
        self.blocks = BlockPool(num_blocks, what="KV block")
        self.rows = BlockPool(max_rows, what="block-table row")
        self.committed_blocks = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        """Queue a validated request whose id is not live."""
        self.live[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> ScheduledStep | None:
        """Build the next step (None when no request is live)."""
        step = ScheduledStep(chunks=[], token_ids=[], requests=[], sample_rows=[])
        budget = self.token_budget
        block_size = self.block_size
        for request in self.running:
            if budget == 0:
                break
            start = request.num_computed
            if start < request.prompt_len:
                continue
            if start == len(request.block_ids) * block_size:
                request.block_ids += self.blocks.allocate(1)
                request.block_tuple = tuple(request.block_ids)
            assert request.row is not None
            step.sample_rows.append(len(step.chunks))
            step.chunks.append(
                ScheduledChunk(
                    row=request.row,
                    block_ids=request.block_tuple,
                    start_position=start,
                    num_tokens=1,
                )
            )
            step.token_ids.append(request.token_ids[start:])
            step.requests.append(request)
            budget -= 1
        for request in self.running:
            if budget == 0:
                break
            if request.num_computed < request.prompt_len:
                budget -= self._feed(step, request, budget)
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            request = self.waiting.popleft()
            self.running.append(request)
            budget -= self._feed(step, request, budget)
        return step if step.chunks else None

    def commit(self, step: ScheduledStep, sampled: Sequence[int | str]) -> list[RequestOutput]:
        """Advance every request of ``step``; ``sampled[j]`` is the token of ``sample_rows[j]``, or
        the reason it could not be sampled (that request then finishes with an error)."""
        for chunk, request in zip(step.chunks, step.requests, strict=True):
            request.num_computed += chunk.num_tokens
        finished: list[RequestOutput] = []
        requests = step.requests
        for index, token in zip(step.sample_rows, sampled, strict=True):
            request = requests[index]
            if isinstance(token, str):
                error = f"request {request.request_id!r} failed: {token}"
                finished.append(self._finish(request, FinishReason.ERROR, error))
                continue
            tokens = request.token_ids
            tokens.append(token)
            if token in request.stop_ids:
                finished.append(self._finish(request, FinishReason.STOP))
            elif len(tokens) >= request.max_len:
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

    def _admit(self, request: Request) -> bool:
        if self.rows.num_free == 0:
            return False
        if self.committed_blocks + request.max_blocks > self.blocks.size:
            return False
        request.row = self.rows.allocate(1)[0]
        self.committed_blocks += request.max_blocks
        return True

    def _feed(self, step: ScheduledStep, request: Request, limit: int) -> int:
        start = request.num_computed
        total = len(request.token_ids)
        count = min(total - start, limit)
        needed = -(-(start + count) // self.block_size)
        if needed > len(request.block_ids):
            request.block_ids.extend(self.blocks.allocate(needed - len(request.block_ids)))
            request.block_tuple = tuple(request.block_ids)
        assert request.row is not None
        if start + count == total:
            step.sample_rows.append(len(step.chunks))
        step.chunks.append(
            ScheduledChunk(
                row=request.row,
                block_ids=request.block_tuple,
                start_position=start,
                num_tokens=count,
            )
        )
        step.token_ids.append(request.token_ids[start : start + count])
        step.requests.append(request)
        return count

    def _finish(
        self, request: Request, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        assert request.row is not None
        self.blocks.free(request.block_ids)
        self.rows.free([request.row])
        self.committed_blocks -= request.max_blocks
        request.block_ids = []
        request.block_tuple = ()
        request.row = None
        del self.live[request.request_id]
        return request.output(reason, error)
