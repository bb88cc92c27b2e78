"""Each HTTP connection's clock: a request arrives whole in bounded time, and an idle connection
is closed only when nothing is waiting on it.

uvicorn (h11) alone has neither: a request whose head or body never ends holds its connection
forever (slowloris), and its keep-alive timer, armed when a response ends, closes the connection
even when the client's next request has already arrived but the event loop, stalled, has not
read it yet, so the client sees a reset for a request it sent (and may not retry a POST).

Invariants:
- From the first byte of a request (or the opening of a connection, for its first) to the last
  byte of its body, at most ``request_timeout_s`` pass: past it, a request of which anything
  arrived is answered 408 (an OpenAI error object, ``Connection: close``) unless its response
  has started, and the connection is closed; a connection that sent nothing is just closed. The
  application sees the client as gone (``http.disconnect``).
- The keep-alive timer never closes a connection whose socket has bytes to read: it waits one
  more period, and the bytes (a request) are read and answered as any other.
- A request that is not HTTP/1.1 (a malformed head, a head over h11's 16 KiB, a path that is
  not ASCII) is answered 400 with an error object and the connection closed (uvicorn writes
  plain text, or for the path, resets the connection).
- Nothing else of uvicorn's h11 protocol changes.
"""

from __future__ import annotations

import asyncio
import select

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from runners.serve.errors import ApiError, error_body

__all__ = ["GuardedProtocol", "guarded_protocol"]

_RECEIVING = (h11.IDLE, h11.SEND_BODY)
"""The client's h11 states while a request has not arrived whole."""


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the clock of the module docstring."""

    request_timeout_s: float = 30.0
    _request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._request_timer is None:
            self._arm()  # the first bytes of a request on a kept-alive connection
        try:
            super().data_received(data)
        except UnicodeDecodeError:  # uvicorn decodes the path as ASCII
            self._refuse("the request's path is not ASCII (percent-encode it)")
            return
        if self.conn.their_state not in _RECEIVING:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._disarm()  # idle now: the keep-alive timer's

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refuses (``msg`` says only that), as an object."""
        self._refuse("the request is not valid HTTP/1.1 (a malformed head, or one over 16 KiB)")

    def _refuse(self, message: str) -> None:
        self._disarm()
        self.transport.write(_raw_response(ApiError(400, message)))
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and self._readable():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()

    def _arm(self) -> None:
        self._disarm()
        self._request_timer = self.loop.call_later(self.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _readable(self) -> bool:
        """Whether the socket holds bytes (or an end) the event loop has not read yet."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()  # not select(): a server may hold more than 1,024 descriptors
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def _timed_out(self) -> None:
        self._request_timer = None
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            return
        started = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        responding = self.cycle is not None and self.cycle.response_started
        if self.conn.their_state is h11.SEND_BODY and self.cycle is not None:
            self.cycle.disconnected = True  # the application stops waiting for the body
            self.cycle.message_event.set()
        if started and not responding:
            timeout = self.request_timeout_s
            message = f"the request did not arrive whole within {timeout:g} s; send it faster"
            self.transport.write(_raw_response(ApiError(408, message)))
        self.transport.close()


def _raw_response(error: ApiError) -> bytes:
    """``error`` as the bytes of a whole HTTP/1.1 response that closes the connection."""
    body = error_body(error)
    reason = {400: "Bad Request", 408: "Request Timeout"}[error.status]
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def guarded_protocol(request_timeout_s: float) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's ``http`` option, with this request timeout."""
    return type("GuardedProtocol", (GuardedProtocol,), {"request_timeout_s": request_timeout_s})
