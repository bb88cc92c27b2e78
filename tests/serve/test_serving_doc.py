"""docs/serving.md runs as written: its marked blocks, in order, in an empty directory — the
checkpoint, the server (on a free port, which replaces the page's 8000), curl, the ``openai``
client, the metrics and ``bench-serve``; and, as a slow test, ``transformers serve`` under the
same load."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.serve.support import ServerProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
_BLOCK = re.compile(r"<!-- serving-doc: ([\w-]+) -->\n```(\w+)\n(.*?)```", re.DOTALL)
PAGE_URL = "http://127.0.0.1:8000"
PEER_URL = "http://localhost:8001"
BLOCKS = [(m.group(1), m.group(3)) for m in _BLOCK.finditer(DOC.read_text())]
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def bash(script: str, cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{script}\n{done.stderr}"
    return done.stdout


def test_the_page_marks_every_step() -> None:
    roles = [role for role, _ in BLOCKS]
    assert roles == ["setup", "server", "client", "python", "client", "bench", "peer", "bench-peer"]


def test_the_serving_page_runs_as_written(tmp_path: Path) -> None:
    server: ServerProcess | None = None
    try:
        for role, code in BLOCKS:
            if role == "setup":
                bash(code, tmp_path)
            elif role == "server":
                argv = shlex.split(code)
                assert argv[:2] == ["dsv4", "serve"] and "--port" not in argv
                server = ServerProcess(*argv[2:], cwd=tmp_path)
            elif role in ("client", "bench"):
                assert server is not None
                out = bash(code.replace(PAGE_URL, server.url), tmp_path)
                assert out.strip() and '"error"' not in out
                if role == "bench":
                    assert "8 of 8 requests" in out
            elif role == "python":
                assert server is not None
                done = subprocess.run(
                    [sys.executable, "-c", code.replace(PAGE_URL, server.url)],
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert done.returncode == 0, done.stderr
                assert "CompletionUsage(completion_tokens=8" in done.stdout
        assert server is not None
        code, out = server.stop()
        assert code == 0 and "requests" in out
    finally:
        if server is not None:
            server.kill()


@pytest.mark.slow
def test_the_peer_comparison_runs_as_written(tmp_path: Path) -> None:
    """``transformers serve`` on the page's checkpoint, loaded by the page's bench command."""
    steps = dict(BLOCKS)
    bash(steps["setup"], tmp_path)
    argv = shlex.split(steps["peer"])
    assert argv[:2] == ["transformers", "serve"]
    port = argv.index("--port") + 1
    argv[port] = "0"
    peer = subprocess.Popen(
        argv, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert peer.stdout is not None
        for line in peer.stdout:
            found = re.search(r"running on (http://\S+)", line)
            if found:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and url, "transformers serve did not start"
        out = bash(steps["bench-peer"].replace(PEER_URL, url[0]), tmp_path)
        assert "8 of 8 requests" in out
    finally:
        peer.terminate()
        try:
            peer.wait(30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait(30)
