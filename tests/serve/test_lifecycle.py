"""A server's life and death, each on a server of its own (the built-in model, no graphs, so it
starts in seconds): a full queue answers 503 with Retry-After; SIGTERM lets a request in flight
finish (or, past the grace period, aborts it) and exits 0 with nothing left running; a rank
killed under ``--tensor-parallel-size 2``, idle or mid-stream, ends the server with one line
and a non-zero exit, the stream ending with an error event."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from runners.cli.main import main
from tests.processes import children
from tests.serve.support import DSV4, ServerProcess, wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

FAST = ("--cudagraph-mode", "NONE")
LONG = {"model": "dsv4-tiny", "prompt": "Hello", "temperature": 0, "ignore_eos": True}


def _stream(http: httpx.Client, body: dict[str, Any], events: list[dict[str, Any] | str]) -> None:
    """Stream ``body``, appending each event's JSON (or ``[DONE]``) to ``events``."""
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))


@pytest.mark.parametrize("grace", ["60", "0.5"])
def test_sigterm_finishes_or_aborts_what_is_in_flight_and_exits_0(grace: str) -> None:
    server = ServerProcess(
        *FAST,
        *("--max-num-seqs", "1", "--max-queued-requests", "0", "--shutdown-grace", grace),
        *(["--json"] if grace == "60" else []),
        env={"DSV4_API_KEY": "from-the-environment"},
    )
    try:
        events: list[dict[str, Any] | str] = []
        with server.client() as anonymous:
            assert anonymous.post("/v1/completions", json=LONG).status_code == 401
        with server.client("from-the-environment", timeout=300) as http:
            body = dict(LONG, max_tokens=1000)
            streaming = threading.Thread(target=_stream, args=(http, body, events))
            streaming.start()
            wait_for(lambda: len(events) >= 2, timeout=60)
            full = http.post("/v1/completions", json=dict(LONG, max_tokens=4))
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert full.json()["error"]["type"] == "service_unavailable_error"
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: _refused(server.url), timeout=10)
            streaming.join(120)
        code = server.wait(60)
        out = server.process.stdout.read() if server.process.stdout else ""
    finally:
        server.kill()
    assert code == 0, server.stderr
    assert children(server.pid) == []
    if grace == "60":  # it finished: every token, then [DONE]; --json: one object
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        summary = json.loads(out)
        assert summary["requests"] == {"stop": 0, "length": 1, "abort": 0, "error": 0}
        assert summary["model"] == "dsv4-tiny" and summary["generated_tokens"] == 1000
    else:  # cut: never finished, its request aborted with an error event
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert "1 aborted" in out
    assert "Traceback" not in server.stderr


def test_a_port_in_use_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [*DSV4, "serve", "--port", port], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65536"], "argument --port: must be <= 65535"),
        (["--max-request-bytes", "lots"], "argument --max-request-bytes"),
        (["--shutdown-grace", "-1"], "argument --shutdown-grace: must be >= 0"),
    ],
)
def test_bad_server_flags_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.TransportError:
        return True
    return False


def _ranks(server: ServerProcess) -> list[int]:
    found = [
        pid
        for pid in children(server.pid)
        if b"serve_rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return sorted(found)


@pytest.mark.parametrize("when", ["idle", "mid-stream"])
def test_a_killed_rank_ends_the_server_with_one_line(when: str) -> None:
    server = ServerProcess(*FAST, "--tensor-parallel-size", "2")
    try:
        ranks = _ranks(server)
        assert len(ranks) == 2
        events: list[dict[str, Any] | str] = []
        with server.client(timeout=300) as http:
            reply = http.post("/v1/completions", json=dict(LONG, max_tokens=8))
            assert reply.status_code == 200  # two ranks serve
            streaming = None
            if when == "mid-stream":
                body = dict(LONG, max_tokens=1000)
                streaming = threading.Thread(target=_stream, args=(http, body, events))
                streaming.start()
                wait_for(lambda: len(events) >= 2, timeout=60)
            os.kill(ranks[1], signal.SIGKILL)
            code = server.wait(60)
            if streaming is not None:
                streaming.join(60)
    finally:
        server.kill()
    assert code == 1
    assert server.lines[-1].startswith("dsv4 serve: error: the engine failed: rank 1 died")
    assert "killed by signal 9" in server.lines[-1] or "SIGKILL" in server.lines[-1]
    assert wait_for(lambda: not [p for p in ranks if Path(f"/proc/{p}").exists()], 30) >= 0
    if when == "mid-stream":
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "rank 1 died" in errors[0]["error"]["message"]
        assert events[-1] == "[DONE]"


def test_a_request_whose_logits_are_nan_fails_alone(tmp_path: Path) -> None:
    """Token 300's embedding is 3e38 in this checkpoint (finite, so it loads; its square is
    not): a prompt holding it gets NaN logits and cannot be sampled.
    It fails alone — a 500 error object, or an error event ending its stream — while a request
    beside it gets its tokens, and the server stays healthy."""
    from safetensors.torch import load_file, save_file

    checkpoint = tmp_path / "ckpt"
    subprocess.run(
        [*DSV4, "init-checkpoint", str(checkpoint), "--preset", "tiny", "--seed", "0"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    weights = load_file(checkpoint / "model.safetensors")
    weights["model.embed_tokens.weight"][300] = 3e38
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    server = ServerProcess(*FAST, "--checkpoint", str(checkpoint))
    try:
        with server.client(timeout=300) as http:
            good = {"model": str(checkpoint), "prompt": "Hello", "max_tokens": 40, "temperature": 0}
            alone = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
            events: list[dict[str, Any] | str] = []
            beside = threading.Thread(target=_stream, args=(http, good, events))
            beside.start()
            bad = dict(good, prompt=[72, 300])
            failed = http.post("/v1/completions", json=bad)
            assert failed.status_code == 500 and "NaN" in failed.json()["error"]["message"]
            broken: list[dict[str, Any] | str] = []
            _stream(http, bad, broken)
            assert "NaN" in broken[-2]["error"]["message"] and broken[-1] == "[DONE]"  # type: ignore[index]
            beside.join(120)
            texts = [
                e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]
            ]
            assert "".join(texts) == alone
            assert http.get("/health").status_code == 200
        code, _ = server.stop()
        assert code == 0
    finally:
        server.kill()
