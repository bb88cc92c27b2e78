"""Ctrl-C at any moment of ``dsv4 run`` — start-up imports, capture, generation — is one line on
stderr and exit code 130, never a traceback."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import pytest

DSV4 = shutil.which("dsv4", path=str(Path(sys.executable).parent))


def _restore_default_sigint() -> None:
    # A child inherits an ignored SIGINT (e.g. under a backgrounded CI shell); Python then never
    # raises KeyboardInterrupt. Give the child the terminal's default, as a person's shell does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("delay", [0.2, 1.2, 2.5], ids=["importing", "starting", "running"])
def test_ctrl_c_at_any_moment_is_one_line(delay: float) -> None:
    assert DSV4 is not None
    # 32 requests one at a time, 400 tokens each: about 12 s of generation here, so the last
    # interrupt lands well inside it (8 requests at once finished in about 3 s, and a signal in
    # the interpreter's shutdown, after its handlers are gone, ends the process without a word)
    command = [DSV4, "run", "--platform", "cpu", "--ignore-eos", "--max-new-tokens", "400"]
    command += ["--max-num-seqs", "1"] + ["--prompt", "Hello"] * 32
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_restore_default_sigint,
    )
    time.sleep(delay)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err == "dsv4 run: interrupted\n"


def test_an_interrupt_a_library_turned_into_its_own_error_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from runners.cli import main as cli

    def interrupted_while_capturing(args: object) -> NoReturn:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("capture aborted") from interrupt

    monkeypatch.setattr(cli.run, "execute", interrupted_while_capturing)
    assert cli.main(["run", "--platform", "cpu", "--prompt", "Hi"]) == 130
    assert capsys.readouterr().err == "dsv4 run: interrupted\n"
    monkeypatch.setattr(cli.run, "execute", lambda args: (_ for _ in ()).throw(ValueError("no")))
    assert cli.main(["run", "--platform", "cpu", "--prompt", "Hi"]) == 1  # a real error stays one
