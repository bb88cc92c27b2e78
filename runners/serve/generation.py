"""One HTTP request's work in the engine: its sampling parameters, and its choices (one engine
request per prompt and choice) from submission to their last update.

Invariants:
- ``sampling_params`` maps the request's fields onto ``SamplingParams`` with OpenAI's defaults
  (``temperature`` 1.0); a value the engine refuses is a 400 naming the field.
- A ``Generation`` either has all of its choices accepted by the engine or none: if one is
  refused, those already added are aborted and the refusal is raised.
- Whatever ends the consumer (the last update, a client that left, a failure, shutdown),
  ``close`` aborts every choice that has not finished and gives back its admission slot, once.
- Choice ``index`` is ``prompt * n + i`` (OpenAI's order for several prompts).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from runners.engine import (
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    RequestUpdate,
    SamplingParams,
)
from runners.serve.context import ServerContext
from runners.serve.engine_loop import EngineDeadError
from runners.serve.errors import ApiError
from runners.serve.protocol import SamplingRequest

__all__ = ["Generation", "new_id", "raise_if_failed", "sampling_params"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def raise_if_failed(outputs: Sequence[RequestOutput]) -> None:
    """A choice whose tokens could not be sampled fails its whole (unstreamed) request: 500."""
    failed = next((o for o in outputs if o.finish_reason is FinishReason.ERROR), None)
    if failed is not None:
        raise ApiError(500, failed.error or "the request failed")


def sampling_params(
    request: SamplingRequest, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The engine's parameters for ``request`` (module docstring)."""
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": max(0, request.top_k or 0),
        "min_p": request.min_p or 0.0,
        "seed": request.seed,
        "n": request.n,
        "stop": () if request.stop is None else request.stop,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "stop_token_ids": request.stop_token_ids or (),
        "ignore_eos": request.ignore_eos,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "repetition_penalty": request.repetition_penalty or 1.0,
        "logprobs": logprobs,
    }
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        field = str(exc).split()[0]
        raise ApiError(400, str(exc), param=field if field in fields else None) from None


class Generation:
    """The choices of one HTTP request (module docstring)."""

    def __init__(
        self, context: ServerContext, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> None:
        self.context = context
        self.prompts = [list(p) for p in prompts]
        self.params = params
        base = new_id("req")
        self._ids = [f"{base}-{i}" for i in range(len(self.prompts) * params.n)]
        self._index = {request_id: i for i, request_id in enumerate(self._ids)}
        self._queue: asyncio.Queue[tuple[int, RequestUpdate | str]] = asyncio.Queue()
        self._open: set[str] = set()
        """Choices added to the engine and not finished."""
        self._held: set[str] = set()
        """Choices holding an admission slot."""

    @property
    def num_choices(self) -> int:
        return len(self._ids)

    async def start(self) -> None:
        """Admit and add every choice (module docstring)."""
        self.context.admit(self.num_choices)
        self._held = set(self._ids)
        n = self.params.n
        adds = []
        for index, request_id in enumerate(self._ids):
            prompt = self.prompts[index // n]
            params = self.params.choice(index % n)
            self._open.add(request_id)
            adds.append(self.context.loop.add(request_id, prompt, params, self._sink(index)))
        try:  # all at once: the engine takes them in one go, between two steps
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:
            self.close()
            raise
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            self.close()
            raise refused[0]

    async def updates(self) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """Each choice's updates as they come, until every choice has finished; raises
        ``EngineDeadError`` if the engine fails meanwhile."""
        while self._open:
            index, update = await self._queue.get()
            if isinstance(update, str):
                raise EngineDeadError(update)
            if update.finished is not None:
                self._finish(self._ids[index])
            yield index, update

    async def outputs(self) -> list[RequestOutput]:
        """Every choice's output, in choice order, once all have finished."""
        outputs: dict[int, RequestOutput] = {}
        async for index, update in self.updates():
            if update.finished is not None:
                outputs[index] = update.finished
        return [outputs[i] for i in range(self.num_choices)]

    def close(self) -> None:
        """Abort what has not finished and give back the admission slots (idempotent)."""
        for request_id in list(self._open):
            self.context.loop.abort(request_id)
        for request_id in list(self._held):
            self._finish(request_id)

    def _finish(self, request_id: str) -> None:
        self._open.discard(request_id)
        if request_id in self._held:
            self._held.discard(request_id)
            self.context.release()

    def _sink(self, index: int) -> Callable[[RequestUpdate | str], None]:
        def put(update: RequestUpdate | str) -> None:
            self._queue.put_nowait((index, update))

        return put
