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


def test_progress_on_a_terminal_rewrites_one_line_per_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stderr = _Stream(True)
    monkeypatch.setattr("sys.stderr", stderr)
    progress = Progress.for_terminal(json_output=False)
    progress.update("capturing graphs")
    progress.update("captured FULL graph for 4 tokens")
    progress.done("captured 2 graphs")
    progress.update("generating")
    progress.done("generated 8 tokens")
    first, second, rest = stderr.getvalue().split("\n")
    assert rest == ""  # each phase ends its line; nothing after the last
    draws = [d.rstrip() for d in first.split("\r")[1:]]
    assert draws[0] == "capturing graphs [00:00]"
    assert "captured FULL graph for 4 tokens [00:00]" in draws
    assert draws[-1] == "captured 2 graphs [00:00]"
    assert second.split("\r")[-1].rstrip() == "generated 8 tokens [00:00]"


def test_no_progress_with_json_even_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Stream(True)
    monkeypatch.setattr("sys.stderr", stderr)
    progress = Progress.for_terminal(json_output=True)
    progress.update("capturing graphs")
    progress.done("captured")
    assert stderr.getvalue() == ""


def test_explain_help_says_the_platform_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    from runners.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--platform PLATFORM platform name (cuda, rocm, cpu or a plugin's); required" in text
    assert "default: the current platform" not in text
