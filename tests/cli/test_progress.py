"""Progress lines go to stderr only when stderr is a terminal: never into redirected logs."""

from __future__ import annotations

import io

import pytest

from runners.cli.progress import Progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(("stderr_tty", "stdout_tty"), [(False, True), (False, False)])
def test_no_progress_when_stderr_is_redirected(
    monkeypatch: pytest.MonkeyPatch, stderr_tty: bool, stdout_tty: bool
) -> None:
    stderr = _Stream(stderr_tty)
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr("sys.stdout", _Stream(stdout_tty))
    progress = Progress.for_terminal(json_output=False)
    progress.update("capturing graphs")
    progress.done("captured")
    assert stderr.getvalue() == ""


def test_progress_on_a_terminal_rewrites_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Stream(True)
    monkeypatch.setattr("sys.stderr", stderr)
    progress = Progress.for_terminal(json_output=False)
    progress.update("capturing graphs")
    progress.done("captured")
    assert stderr.getvalue().startswith("\r\033[Kcapturing graphs [")
    assert stderr.getvalue().endswith("]\n")
