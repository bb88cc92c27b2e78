"""A real ``dsv4 serve`` process for the tests: started on a free loopback port (``--port 0``,
the port read from its ready line, so parallel workers never collide), stopped with SIGTERM.

Every wait here is bounded: a server that is not ready in ``READY_S`` seconds, or does not exit
in ``EXIT_S`` after SIGTERM, fails the test (and is killed), never hangs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

DSV4 = [sys.executable, "-m", "dsv4_cli"]
READY_S = 600.0
EXIT_S = 60.0
_READY = re.compile(r"^dsv4 serve: serving .* on (http://\S+)$")


class ServerProcess:
    """One ``dsv4 serve`` process (module docstring); its stderr is collected in ``stderr``."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.args = ["serve", "--port", "0", *args]
        self.process = subprocess.Popen(
            [*DSV4, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(READY_S) or not self.url:
            self.kill()
            raise AssertionError(f"dsv4 serve did not become ready: {self.stderr[-2000:]}")

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))
            match = _READY.match(self.lines[-1])
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # the process ended (before or after being ready)

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    @property
    def pid(self) -> int:
        return self.process.pid

    def client(self, key: str | None = None, timeout: float = 120.0) -> httpx.Client:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Send ``sig`` and wait for the exit; return (exit code, stdout)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            out, _ = self.process.communicate(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"dsv4 serve did not exit within {EXIT_S}s of {sig}") from None
        self._reader.join(5)
        return self.process.returncode, out

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"dsv4 serve did not exit within {timeout}s") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(EXIT_S)


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """The value of one Prometheus sample of ``GET /metrics`` (``labels`` as written in the
    exposition, e.g. ``finished_reason="abort"``)."""
    text = client.get("/metrics").text
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {wanted} in /metrics")


def wait_for(condition: Any, timeout: float, step: float = 0.02) -> float:
    """Poll ``condition()`` until true; return the seconds it took (AssertionError on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def offline_outputs(args: Sequence[str], prompts: Sequence[str]) -> list[dict[str, Any]]:
    """``dsv4 run --json``'s outputs for text ``prompts`` (one run, all prompts batched)."""
    argv = [*DSV4, "run", *args, "--json"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr
    outputs: list[dict[str, Any]] = json.loads(done.stdout)["outputs"]
    return outputs
