"""Server-sent events as OpenAI streams them, and answering only clients that are still there.

Invariants:
- Each event is ``data: <json>\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``, after an error
  event (``{"error": {...}}``) when it failed.
- A streamed request is closed (its unfinished engine requests aborted) when its stream ends,
  whether it ran out, failed, or the client left — even before the first event.
- ``until_gone`` runs a non-streamed request's work while watching its connection: if the client
  disconnects first, the work is cancelled (its ``finally`` aborts the engine requests) and
  nothing is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from runners.serve.responses import ErrorInfo, ErrorResponse

__all__ = ["DONE", "error_event", "event", "streaming_response", "until_gone"]

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def error_event(message: str, *, status: int = 500) -> str:
    error = ErrorInfo(message=message, type="internal_server_error", code=status)
    return event(ErrorResponse(error=error))


class Closable(Protocol):
    def close(self) -> None: ...


def streaming_response(events: AsyncIterator[str], work: Closable) -> StreamingResponse:
    """The event stream ``events``, closing ``work`` once it is over, however it ends (the
    generator's own ``finally`` does not run if the client leaves before it starts)."""
    return StreamingResponse(
        events, media_type="text/event-stream", background=BackgroundTask(work.close)
    )


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_gone(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first (then None, the work cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None
