"""A client that disconnects mid-request aborts its request: ``dsv4:num_requests_running`` is
back to 0 within a second (the abort counted), and no other request loses a token.

The server is this module's own, with room for 1,000-token requests: a request must outlast the
client's leaving, and at a fraction of a millisecond a token (tiny, FULL graphs) the shared
server's 128-token context is generated before the disconnect reaches the engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve.conftest import KEY, PROMPTS
from tests.serve.support import ServerProcess, metric, wait_for

CONTEXT = 1024
LONG = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
ABORTED = 'finished_reason="abort"'


@pytest.fixture(scope="module")
def long_server(checkpoint: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--checkpoint",
        str(checkpoint),
        "--api-key",
        KEY,
        "--max-model-len",
        str(CONTEXT),
        "--capture-sizes",
        "1,2,4,8,16",
    )
    try:
        yield process
    finally:
        code, _ = process.stop()
        assert code == 0, process.stderr


@pytest.fixture(scope="module")
def http(long_server: ServerProcess) -> Iterator[httpx.Client]:
    with long_server.client(KEY) as client:
        yield client


def _leave_after(http: httpx.Client, body: dict[str, Any], events: int) -> None:
    """Stream ``body`` and close the connection after ``events`` events."""
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == events:
                break


def _running(http: httpx.Client) -> float:
    return metric(http, "dsv4:num_requests_running")


def test_leaving_mid_stream_frees_the_engine_within_a_second(
    http: httpx.Client, model_name: str
) -> None:
    aborted = metric(http, "dsv4:request_success_total", ABORTED)
    _leave_after(http, {"model": model_name, "prompt": PROMPTS[0], **LONG}, events=3)
    left = time.monotonic()
    wait_for(lambda: _running(http) == 0, timeout=1.0)
    assert time.monotonic() - left < 1.0
    assert metric(http, "dsv4:request_success_total", ABORTED) == aborted + 1
    assert metric(http, "dsv4:kv_cache_usage_perc") == 0


def test_leaving_a_plain_request_aborts_it_too(http: httpx.Client, model_name: str) -> None:
    aborted = metric(http, "dsv4:request_success_total", ABORTED)
    # 16 sequences (the most n takes) of 1,000 tokens: seconds of work, many times the
    # client's patience
    body = {"model": model_name, "prompt": PROMPTS[0], "n": 16, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
    wait_for(lambda: _running(http) == 0, timeout=1.0)
    assert metric(http, "dsv4:request_success_total", ABORTED) == aborted + 16


def test_another_request_loses_no_token_when_one_leaves(
    http: httpx.Client, model_name: str
) -> None:
    # the leaver comes and goes within the other's first few hundred tokens
    other = {"model": model_name, "prompt": PROMPTS[11], **LONG}
    alone = http.post("/v1/completions", json=other).json()["choices"][0]["text"]
    pieces: list[str] = []

    def stream_other() -> None:
        with http.stream("POST", "/v1/completions", json=dict(other, stream=True)) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(
                        httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                    )

    thread = threading.Thread(target=stream_other)
    thread.start()
    wait_for(lambda: len(pieces) >= 2, timeout=60)
    aborted = metric(http, "dsv4:request_success_total", ABORTED)
    _leave_after(http, {"model": model_name, "prompt": PROMPTS[0], **LONG}, events=1)
    wait_for(lambda: metric(http, "dsv4:request_success_total", ABORTED) == aborted + 1, 1.0)
    assert len(pieces) < LONG["max_tokens"]  # still streaming when this one left
    thread.join(120)
    assert "".join(pieces) == alone
