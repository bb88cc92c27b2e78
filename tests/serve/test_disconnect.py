"""A client that disconnects mid-request aborts its request: ``dsv4:num_requests_running`` is
back to 0 within a second (the abort counted), and no other request loses a token."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.conftest import KEY, PROMPTS
from tests.serve.support import ServerProcess, metric, wait_for

LONG = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}
ABORTED = 'finished_reason="abort"'


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(KEY) as client:
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
    # 16 sequences (the most n takes) of 120 tokens: about half a second of work on a quiet
    # machine, five times the client's patience
    body = {"model": model_name, "prompt": PROMPTS[0], "n": 16, **LONG, "max_tokens": 120}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
    wait_for(lambda: _running(http) == 0, timeout=1.0)
    assert metric(http, "dsv4:request_success_total", ABORTED) == aborted + 16


def test_another_request_loses_no_token_when_one_leaves(
    http: httpx.Client, model_name: str
) -> None:
    # the longest the context allows ("tiny" is at most 5 tokens of 128): at about a millisecond
    # a token, the leaver comes and goes within its first few dozen tokens
    other = {"model": model_name, "prompt": PROMPTS[11], **LONG, "max_tokens": 120}
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
    assert len(pieces) < 120  # the other request was still streaming when this one left
    thread.join(120)
    assert "".join(pieces) == alone
