"""The thread count a run uses: the user's ``--threads``, else the fastest measured for the
model's size (``runners.threads``)."""

from __future__ import annotations

import json

import pytest
import torch

from runners.cli.main import main
from runners.threads import SINGLE_THREAD_MAX_HIDDEN, default_threads


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    argv = ["run", "--platform", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    argv += ["--cudagraph-mode", "NONE"]  # the thread count, not capture, is under test
    assert main([*argv, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_small_models_run_on_one_thread_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(2)
    assert _run(capsys)["threads"] == 1
    assert _run(capsys, "--threads", "2")["threads"] == 2


def test_the_rule_keeps_torchs_default_above_the_measured_sizes() -> None:
    assert default_threads(SINGLE_THREAD_MAX_HIDDEN) == 1
    assert default_threads(SINGLE_THREAD_MAX_HIDDEN + 1) is None


def test_a_bad_thread_count_is_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--platform", "cpu", "--prompt-ids", "1", "--threads", "0"]) == 2
    assert "argument --threads: must be >= 1, got 0" in capsys.readouterr().err
