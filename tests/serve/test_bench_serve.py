"""``dsv4 bench-serve`` measures any OpenAI-compatible server: against ``dsv4 serve`` every
request completes with the tokens the server reports; against a scripted server, tokens come
from ``usage`` (not from the chunks), and a stream without usage, an error status or an
unreachable server is reported as a failure."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest

from runners.cli.main import main
from runners.measure.serving_load import make_prompts
from tests.serve.conftest import KEY
from tests.serve.support import ServerProcess, metric


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["bench-serve", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out else {}


def test_against_dsv4_serve_every_request_completes_with_the_reported_tokens(
    server: ServerProcess, model_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = bench(
        capsys,
        *("--base-url", server.url, "--model", model_name, "--api-key", KEY),
        *("--num-prompts", "6", "--concurrency", "3", "--input-len", "20", "--output-len", "12"),
        "--ignore-eos",
    )
    assert code == 0 and (report["completed"], report["failed"]) == (6, 0)
    assert report["mean_output_tokens"] == 12  # ignore_eos: every reply is output-len long
    with server.client(KEY) as http:
        counts = [
            http.post("/tokenize", json={"model": model_name, "prompt": p}).json()["count"]
            for p in make_prompts(6, 20, seed=0)
        ]
    assert report["mean_prompt_tokens"] == pytest.approx(sum(counts) / 6)
    for latency in ("ttft_ms", "itl_ms", "e2e_ms"):
        values = report[latency]
        assert 0 < values["p50"] <= values["p90"] <= values["p99"]
    # duration_s is rounded to the millisecond (a run here takes about 40 ms), the throughput
    # computed from the unrounded duration
    duration = report["duration_s"]
    assert 6 * 12 / (duration + 5e-4) <= report["output_throughput"] <= 6 * 12 / (duration - 5e-4)


def test_a_shared_prefix_is_found_in_dsv4_serves_prefix_cache(
    server: ServerProcess, model_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts of 160 shared characters (74 tokens of the toy tokenizer in common) and 10 of
    their own: every request but the first (and the second, when it is admitted in the same
    step) finds 64 tokens cached."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        hits = metric(http, "dsv4:prefix_cache_hits_total")
        code, report = bench(
            capsys,
            *("--base-url", server.url, "--model", model_name, "--api-key", KEY),
            *("--num-prompts", "6", "--concurrency", "2", "--input-len", "10"),
            *("--shared-prefix-len", "160", "--output-len", "4"),
        )
        assert code == 0 and (report["completed"], report["shared_prefix_len"]) == (6, 160)
        assert metric(http, "dsv4:prefix_cache_hits_total") - hits in (4 * 64, 5 * 64)
    prompts = make_prompts(6, 10, seed=0, shared_prefix_len=160)
    assert {p[:160] for p in prompts} == {prompts[0][:160]} and len(set(prompts)) == 6


class _Scripted(BaseHTTPRequestHandler):
    """Streams ``chunks`` text pieces of two tokens each, then (unless ``usage`` is None) the
    usage, then ``[DONE]``; or answers ``status`` with an error object."""

    chunks = 3
    usage: ClassVar[dict[str, int] | None] = {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
    }
    status = 200
    done = True

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.status != 200:
            self.send_response(self.status)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "nope"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(self.chunks):
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "ab"}]}\n\n')
        if self.usage is not None:
            self.wfile.write(
                f"data: {json.dumps({'choices': [], 'usage': self.usage})}\n\n".encode()
            )
        if self.done:
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def scripted() -> Iterator[tuple[str, type[_Scripted]]]:
    handler = type("Handler", (_Scripted,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("done", [True, False], ids=["[DONE]", "closed"])
def test_tokens_come_from_usage_not_from_chunks(
    scripted: tuple[str, type[_Scripted]], capsys: pytest.CaptureFixture[str], done: bool
) -> None:
    """A stream may end with ``[DONE]`` or by closing, as ``transformers serve``'s do."""
    url, handler = scripted
    handler.done = done
    code, report = bench(capsys, "--base-url", url, "--model", "m", "--num-prompts", "4")
    assert code == 0 and report["completed"] == 4
    assert (report["mean_output_tokens"], report["mean_prompt_tokens"]) == (6, 5)  # not 3 chunks


@pytest.mark.parametrize(
    ("change", "error"),
    [({"usage": None}, "the stream ended without usage"), ({"status": 503}, "HTTP 503")],
)
def test_a_broken_reply_is_a_failure_with_its_reason(
    scripted: tuple[str, type[_Scripted]],
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    error: str,
) -> None:
    url, handler = scripted
    for name, value in change.items():
        setattr(handler, name, value)
    code = main(["bench-serve", "--base-url", url, "--model", "m"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith("dsv4 bench-serve: error: ") and error in captured.err


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "m"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "did not serve a completion" in err
