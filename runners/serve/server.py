"""Running the application: uvicorn on a socket bound beforehand, the engine loop beside it, and
a shutdown that ends every request.

Invariants:
- The socket is bound before the engine is built (a port in use fails at once), and the server
  answers only once the engine is built and its graphs are captured: ``/health`` is 200 from
  the first connection it accepts.
- SIGTERM or SIGINT stops accepting connections, lets requests in flight finish for up to
  ``grace_s`` seconds, then aborts them (each ends with an error event, or a 503, saying the
  server is shutting down), stops the engine loop, and returns normally (exit 0). A second
  SIGINT skips the grace period. Unlike uvicorn's own handling, the signal is not raised again
  afterwards (which would end the process with its default action instead of exit 0).
- When the engine fails, the server shuts down the same way and ``serve`` returns the reason,
  so the command ends with one line and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from runners.serve.connections import guarded_protocol
from runners.serve.engine_loop import SHUTTING_DOWN, EngineLoop

__all__ = ["bind", "serve"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port the system picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


_CANCEL_AFTER_S = 5.0
"""Seconds after the grace period before uvicorn cancels what still runs (nothing should:
every request was aborted at the end of the grace period)."""


class _Server(uvicorn.Server):
    """uvicorn with the signal handling of the module docstring."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace_s: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._stop) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        self.should_exit = True
        if self.loop is None:
            return
        if first:
            self.loop.call_soon_threadsafe(self._end_grace_later)
        elif signum == signal.SIGINT:
            self.engine_loop.abort_all(SHUTTING_DOWN)

    def _end_grace_later(self) -> None:
        assert self.loop is not None
        self.loop.call_later(self.grace_s, self.engine_loop.abort_all, SHUTTING_DOWN)


def serve(
    app: FastAPI,
    sock: socket.socket,
    engine_loop: EngineLoop,
    *,
    grace_s: float,
    on_ready: Callable[[], None],
    request_timeout_s: float,
    keep_alive_s: float,
    log_level: str = "warning",
) -> str | None:
    """Serve ``app`` on ``sock`` with ``engine_loop`` until a signal or the engine's failure;
    return the failure's reason (None after a signal). Each connection keeps the clock of
    ``connections``: ``request_timeout_s`` for a request to arrive whole, ``keep_alive_s`` idle
    before it is closed."""
    config = uvicorn.Config(
        app,
        http=guarded_protocol(request_timeout_s),
        lifespan="off",
        access_log=False,
        log_level=log_level,
        timeout_graceful_shutdown=grace_s + _CANCEL_AFTER_S,  # type: ignore[arg-type]  # a float
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # a float
    )
    server = _Server(config, engine_loop, grace_s)
    failure: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server.loop = loop

        def died(reason: str) -> None:
            failure.append(reason)
            server.should_exit = True

        def tell(reason: str) -> None:
            loop.call_soon_threadsafe(died, reason)

        engine_loop.on_death = tell
        engine_loop.start(loop)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            on_ready()
        await serving

    try:
        asyncio.run(main())
    finally:
        engine_loop.stop()
    return failure[0] if failure else None
