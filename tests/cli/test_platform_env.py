"""``DSV4_PLATFORM`` naming a platform this machine lacks, with ``--simulate``: the policy runs on
the CPU tape (it is not refused with advice to pass the very flag that was passed)."""

from __future__ import annotations

import json

import pytest
import torch

from runners.cli.main import main


@pytest.mark.skipif(torch.version.hip is not None, reason="rocm is available on a ROCm build")
def test_simulate_honours_a_platform_named_by_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSV4_PLATFORM", "rocm")
    argv = ["run", "--simulate", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main([*argv, "--cudagraph-mode", "NONE", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["platform"] == "rocm" and payload["simulated"] is True
    assert main(["run", "--prompt-ids", "1", "--max-new-tokens", "1"]) == 1  # not simulated
    assert "not available on this machine" in capsys.readouterr().err
