"""Progress lines go to stderr only when stderr is a terminal (never into redirected logs); help
texts say what is true."""

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


def test_explain_help_says_the_platform_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    from runners.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--platform PLATFORM platform name (cuda, rocm, cpu or a plugin's); required" in text
    assert "default: the current platform" not in text
