"""The one thread that owns the engine: it applies what the HTTP handlers ask, steps the ``LLM``
while work exists, and hands each step's updates back to the event loop.

Invariants:
- ``LLM.step`` has exactly one caller, this thread; so do ``add_request`` and ``abort`` (the
  handlers send commands, never call the engine). The event loop never waits on the engine's
  lock: a handler puts a command in a queue and awaits a future or its updates.
- Commands are applied in the order sent, between steps: an ``abort`` sent after an ``add``
  always finds the request added (or already finished), so a request whose client left while
  it was being added is still aborted.
- Each step's updates reach the event loop in one hand-off (``call_soon_threadsafe``), in step
  order; a request's updates arrive in order and its last carries its output.
- An aborted request frees its blocks before the next step; a request ends finished, aborted,
  or failed (its sink is told why).
- Failure of the engine itself (a step that raises: a dead rank, a broken executor), or of the
  idle ``check`` (a rank that died while nothing ran), is fatal and final: every live request is
  failed with the reason, later ``add``s raise ``EngineDeadError``, ``failure`` says why, and
  ``on_death`` is called once (the server then exits non-zero). Nothing waits forever on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from runners.distributed import RankFailedError, one_line
from runners.engine import LLM, EngineError, RequestUpdate, SamplingParams
from runners.serve.metrics import Metrics

__all__ = ["SHUTTING_DOWN", "EngineDeadError", "EngineLoop", "Sink"]

IDLE_CHECK_S = 0.5
"""Seconds between health checks while no request is live."""
SHUTTING_DOWN = "the server is shutting down"

Sink = Callable[[RequestUpdate | str], None]
"""Receives a request's updates in the event loop; a ``str`` is the engine's failure."""


class EngineDeadError(RuntimeError):
    """The engine failed and can serve no more (the message says why)."""


@attrs.define
class _Live:
    """What the loop keeps about a request it serves."""

    sink: Sink
    arrival: float
    prompt_tokens: int
    last_token: float | None = None


class EngineLoop:
    """Owns ``llm`` in its own thread (see the module docstring)."""

    def __init__(
        self,
        llm: LLM,
        metrics: Metrics,
        *,
        check: Callable[[], None] = lambda: None,
        on_death: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """``check`` raises when the engine can no longer serve (a rank died while idle);
        ``on_death`` is called once, from this thread, with the reason it failed."""
        self.llm = llm
        self.metrics = metrics
        self._check = check
        self.on_death = on_death
        """Called once, from the loop's thread, with the reason the engine failed."""
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        """Requests added and not yet ended (touched by this thread only)."""
        self._updates: list[tuple[Sink, RequestUpdate | str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="dsv4-engine-loop", daemon=True)
        self._stopping = False
        self._gate = threading.Lock()
        """Held while a command is queued, and while the thread stops taking them: so no
        ``add`` is queued after the thread has stopped looking (it would wait forever)."""
        self._closed: str | None = None
        """Why no more commands are taken (the engine failed, or the loop stopped)."""
        self.failure: str | None = None
        self._preemptions = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start stepping; updates are handed to ``loop``."""
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every live request and end the thread (idempotent)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def add(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, sink: Sink
    ) -> None:
        """Queue a request; return once the engine accepted it. Raises the engine's
        ``InvalidRequestError`` for a request it refuses, ``EngineDeadError`` once it failed."""
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        live = _Live(sink=sink, arrival=time.monotonic(), prompt_tokens=len(prompt))
        self._send("add", (request_id, list(prompt), params, live, accepted))
        await accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once it ended); never blocks."""
        self._send("abort", request_id)

    def abort_all(self, reason: str) -> None:
        """Abort every live request, telling each one's sink ``reason``; never blocks."""
        self._send("abort_all", reason)

    def _send(self, kind: str, payload: Any) -> None:
        with self._gate:
            if self._closed is not None:
                if kind == "add":
                    raise EngineDeadError(self._closed)
                return
            self._commands.put((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                busy = self.llm.has_unfinished()
                if not busy:
                    self._wake.wait(IDLE_CHECK_S)
                self._wake.clear()
                self._apply_commands()
                if self._stopping:
                    break
                if self.llm.has_unfinished():
                    self.llm.step()
                    self._hand_off()
                else:
                    self._check()
                self._observe()
        except BaseException as exc:
            known = isinstance(exc, RankFailedError | EngineError)  # their messages say it all
            self._die(" ".join(str(exc).split()) if known else one_line(exc))
            return
        self._close(SHUTTING_DOWN)
        self._abort_all(SHUTTING_DOWN)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._abort(payload)
                continue
            if kind == "abort_all":
                self._abort_all(payload)
                continue
            request_id, prompt, params, live, accepted = payload
            try:
                self.llm.add_request(
                    prompt, params, request_id=request_id, listener=self._listener(request_id)
                )
            except Exception as exc:
                self._resolve(accepted, exc)
                continue
            self._live[request_id] = live
            self._resolve(accepted, None)

    def _listener(self, request_id: str) -> Callable[[RequestUpdate], None]:
        def listen(update: RequestUpdate) -> None:
            live = self._live.get(request_id)
            if live is None:
                return
            self._account(live, update)
            self._updates.append((live.sink, update))
            if update.finished is not None:
                del self._live[request_id]

        return listen

    def _account(self, live: _Live, update: RequestUpdate) -> None:
        now = time.monotonic()
        tokens = len(update.token_ids)
        if tokens:
            if live.last_token is None:
                self.metrics.first_token(now - live.arrival, live.prompt_tokens)
            else:
                self.metrics.next_tokens(now - live.last_token, tokens)
            self.metrics.generated(tokens)
            live.last_token = now
        if update.finished is not None:
            self.metrics.finished(update.finished.finish_reason.value, now - live.arrival)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if self.llm.abort(request_id) is not None and live is not None:
            self.metrics.finished("abort", time.monotonic() - live.arrival)

    def _abort_all(self, reason: str) -> None:
        for request_id, live in list(self._live.items()):
            self._abort(request_id)
            self._updates.append((live.sink, reason))
        self._hand_off()

    def _hand_off(self) -> None:
        updates, self._updates = self._updates, []
        if updates and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
                self._loop.call_soon_threadsafe(_deliver, updates)

    def _observe(self) -> None:
        stats = self.llm.stats()
        self.metrics.engine_state(stats)

    def _die(self, reason: str) -> None:
        self.failure = f"the engine failed: {reason}"
        self._close(self.failure)
        for live in self._live.values():
            self._updates.append((live.sink, self.failure))
        self._live.clear()
        self._hand_off()
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody to tell
            self.on_death(self.failure)

    def _close(self, reason: str) -> None:
        """Take no more commands; refuse the adds already queued."""
        with self._gate:
            self._closed = reason
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._resolve(payload[-1], EngineDeadError(reason))

    def _resolve(self, future: asyncio.Future[None], error: Exception | None) -> None:
        if self._loop is None:
            return

        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(settle)


def _deliver(updates: list[tuple[Sink, RequestUpdate | str]]) -> None:
    for sink, update in updates:
        sink(update)
