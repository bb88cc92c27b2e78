"""A request that fails in ``dsv4 run`` (its logits turned NaN) is reported alone: the other
outputs are printed as usual, the failed one carries its error, and the exit code is 1."""

from __future__ import annotations

import json

import pytest
import torch

from runners import spec as engine_spec
from runners.cli.main import main

POISONED_TOKEN = 7


def test_a_failed_request_is_reported_alone_with_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    build = engine_spec.build_model

    def with_a_poisoned_token(spec: engine_spec.EngineSpec):  # type: ignore[no-untyped-def]
        model = build(spec)
        with torch.no_grad():
            model.model.embed_tokens.weight[POISONED_TOKEN] = float("nan")
        return model

    monkeypatch.setattr(engine_spec, "build_model", with_a_poisoned_token)
    argv = ["run", "--platform", "cpu", "--prompt-ids", "1,2,3", "--prompt-ids", "5,7"]
    assert main([*argv, "--max-new-tokens", "3", "--json"]) == 1
    first, second = json.loads(capsys.readouterr().out)["outputs"]
    assert first["finish_reason"] == "length" and len(first["output_ids"]) == 3
    assert "error" not in first
    assert second["finish_reason"] == "error" and "NaN or inf" in second["error"]
