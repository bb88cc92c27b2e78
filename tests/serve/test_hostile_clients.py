"""One client's request cannot hurt another's: while the largest body the limit allows arrives,
``/health`` and a small completion on other connections answer within half a second; requests
that never end (slowloris heads and bodies) are answered 408 or closed within the request
timeout; a request sent on a kept-alive connection while the server is stalled past its
keep-alive timeout is answered, never reset; malformed HTTP gets an error object.

The server is this module's own: the default body limit (1 MiB at a 1,024-token context), a
request timeout of 2 s and a keep-alive timeout of 1 s, so each wait here is short.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from runners.cli.serve import default_body_bytes
from tests.serve.conftest import KEY
from tests.serve.support import ServerProcess

CONTEXT = 1024
LIMIT = default_body_bytes(CONTEXT)
REQUEST_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
RESPONSIVE_S = 0.5
"""How long ``/health`` and a small completion may take while another client misbehaves."""
SMALL = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(checkpoint: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        *("--checkpoint", str(checkpoint), "--api-key", KEY),
        *("--max-model-len", str(CONTEXT), "--capture-sizes", "1,2,4"),
        *("--request-timeout", str(REQUEST_TIMEOUT_S)),
        *("--keep-alive-timeout", str(KEEP_ALIVE_S)),
    )
    try:
        yield process
    finally:
        code, _ = process.stop()
        assert code == 0, process.stderr


def _address(server: ServerProcess) -> tuple[str, int]:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _exactly(limit: int, make: Callable[[str], dict[str, Any]]) -> bytes:
    """The JSON body ``make(filler)`` grown with ASCII filler to exactly ``limit`` bytes."""
    empty = len(json.dumps(make("")).encode())
    body = json.dumps(make("a" * (limit - empty))).encode()
    assert len(body) == limit
    return body


def _ids(limit: int, field: str, model: str, **fields: Any) -> bytes:
    """A body of ``limit`` bytes whose ``field`` is a list of token ids (``1, 1, ...``)."""
    head = json.dumps({"model": model, **fields, field: []})[:-2]  # up to and with its "["
    count = (limit - len(head) - 1) // 2
    body = head + ",".join(["1"] * count) + "]}"
    padded = (body[:-1] + " " * (limit - len(body)) + "}").encode()
    assert len(padded) == limit and len(json.loads(padded)[field]) == count
    return padded


def _largest_bodies(model: str) -> dict[str, tuple[str, bytes, int]]:
    """Each kind of body at the size limit: route, bytes, the status it gets."""
    messages = lambda text: {  # noqa: E731
        "model": model,
        "messages": [{"role": "user", "content": text}],
    }
    return {
        "text to tokenize": (
            "/tokenize",
            _exactly(LIMIT, lambda text: {"model": model, "prompt": text}),
            400,
        ),
        "a chat message": ("/v1/chat/completions", _exactly(LIMIT, messages), 400),
        "token ids to complete": ("/v1/completions", _ids(LIMIT, "prompt", model), 400),
        "token ids to detokenize": ("/detokenize", _ids(LIMIT, "tokens", model), 200),
    }


def test_while_the_largest_bodies_arrive_other_clients_answer_within_half_a_second(
    guarded: ServerProcess, model_name: str
) -> None:
    bodies = _largest_bodies(model_name)
    statuses: dict[str, list[int]] = {name: [] for name in bodies}
    done = threading.Event()

    def send_them() -> None:
        with guarded.client(KEY) as big:
            for _ in range(3):
                for name, (route, body, _) in bodies.items():
                    headers = {"Content-Type": "application/json"}
                    statuses[name].append(
                        big.post(route, content=body, headers=headers).status_code
                    )
        done.set()

    sender = threading.Thread(target=send_them)
    health: list[float] = []
    completions: list[float] = []
    with guarded.client(KEY) as http:
        sender.start()
        while not done.is_set():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            health.append(time.monotonic() - start)
            start = time.monotonic()
            reply = http.post("/v1/completions", json=dict(SMALL, model=model_name))
            completions.append(time.monotonic() - start)
            assert reply.status_code == 200, reply.text
    sender.join()
    assert statuses == {name: [status] * 3 for name, (_, _, status) in bodies.items()}
    assert len(health) >= 3, "the large bodies were answered before any measurement"
    assert max(health) < RESPONSIVE_S, health
    assert max(completions) < RESPONSIVE_S, completions


def test_a_body_one_byte_over_the_limit_is_a_413(guarded: ServerProcess, model_name: str) -> None:
    body = _exactly(LIMIT + 1, lambda text: {"model": model_name, "prompt": text})
    with guarded.client(KEY) as http:
        reply = http.post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == 413


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(_address(server), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server writes before it closes ``sock``, and the seconds that took."""
    start = time.monotonic()
    received = b""
    sock.settimeout(timeout)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - start


SLOW_STARTS: dict[str, bytes] = {
    "nothing": b"",
    "half a head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
    "a head, half a body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model": '
    ),
}


def test_two_hundred_slowloris_connections_end_within_the_request_timeout(
    guarded: ServerProcess,
) -> None:
    kinds = list(SLOW_STARTS)
    sockets = [(kinds[i % 3], _connect(guarded)) for i in range(200)]
    opened = time.monotonic()
    for kind, sock in sockets:
        sock.sendall(SLOW_STARTS[kind])
    with guarded.client() as http:  # the server still answers everyone else meanwhile
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - start < RESPONSIVE_S
    deadline = opened + REQUEST_TIMEOUT_S + 3.0
    for kind, sock in sockets:
        with sock:
            received, _ = _read_until_closed(sock, max(0.1, deadline - time.monotonic()))
        if kind == "nothing":
            assert received == b"", received
        else:
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), (kind, received)
            error = json.loads(body)["error"]
            assert error["code"] == 408 and error["type"] == "timeout_error"
    assert time.monotonic() < deadline + 1.0  # every socket was closed by the server in time


def test_a_body_shorter_than_its_content_length_gets_408(guarded: ServerProcess) -> None:
    with _connect(guarded) as sock:
        sock.sendall(SLOW_STARTS["a head, half a body"])
        received, took = _read_until_closed(sock, REQUEST_TIMEOUT_S + 3.0)
    assert received.startswith(b"HTTP/1.1 408 ")
    assert REQUEST_TIMEOUT_S - 0.5 < took < REQUEST_TIMEOUT_S + 2.0


def test_requests_sent_while_the_server_is_stalled_past_keep_alive_are_answered(
    guarded: ServerProcess, model_name: str
) -> None:
    """The stall here is SIGSTOP (the issue saw 3 of 3 such requests reset after an 8 s stop,
    with uvicorn's 5 s keep-alive): each client's connection is idle and kept alive when the
    server stops; each sends a POST during the stop, longer than the keep-alive timeout."""
    clients = [
        httpx.Client(
            base_url=guarded.url,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
            limits=httpx.Limits(max_connections=1, keepalive_expiry=60),
        )
        for _ in range(8)
    ]
    try:
        for client in clients:
            assert client.get("/v1/models").status_code == 200  # a connection kept alive
        replies: list[Any] = [None] * len(clients)

        def send(index: int) -> None:
            try:
                replies[index] = (
                    clients[index]
                    .post("/v1/completions", json=dict(SMALL, model=model_name))
                    .status_code
                )
            except httpx.HTTPError as exc:
                replies[index] = repr(exc)

        os.kill(guarded.pid, signal.SIGSTOP)
        try:
            senders = [threading.Thread(target=send, args=(i,)) for i in range(len(clients))]
            for sender in senders:
                sender.start()
            time.sleep(KEEP_ALIVE_S + 1.5)
        finally:
            os.kill(guarded.pid, signal.SIGCONT)
        for sender in senders:
            sender.join(60)
        assert replies == [200] * len(clients)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize(
    ("name", "request_bytes", "status"),
    [
        ("not HTTP", b"HELLO\r\n\r\n", 400),
        ("a path that is not ASCII", b"GET /h\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        ("a head over 16 KiB", b"GET /health HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 400),
    ],
)
def test_malformed_http_gets_an_error_object_and_a_close(
    guarded: ServerProcess, name: str, request_bytes: bytes, status: int
) -> None:
    with _connect(guarded) as sock:
        sock.sendall(request_bytes)
        received, _ = _read_until_closed(sock, 10)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), received
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status and "\n" not in error["message"]
    with guarded.client() as http:
        assert http.get("/health").status_code == 200
