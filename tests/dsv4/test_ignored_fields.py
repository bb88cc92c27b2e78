"""Config fields transformers' DeepSeek-V4 reads and then ignores load here too, with one warning:
its logits are the same whatever they say, and so are ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.hf_config import IgnoredConfigFieldWarning
from dsv4.testing import run_schedule
from runners.cli.main import main
from tests.dsv4.support import hf_logits

PROMPT = list(range(1, 30))
IGNORED = {
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_key_value_heads": 4,
    "attention_bias": True,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same weights twice: with the default config, and with every ignored field changed."""
    plain = save_random_checkpoint(tmp_path_factory.mktemp("plain"), DeepseekV4Config.tiny(), 5)
    odd = tmp_path_factory.mktemp("odd")
    shutil.copytree(plain, odd, dirs_exist_ok=True)
    config = json.loads((odd / "config.json").read_text())
    config.update(IGNORED)
    (odd / "config.json").write_text(json.dumps(config))
    return plain, odd


def test_transformers_ignores_them(checkpoints: tuple[Path, Path]) -> None:
    plain, odd = (transformers.DeepseekV4ForCausalLM.from_pretrained(d).eval() for d in checkpoints)
    assert torch.equal(hf_logits(plain, PROMPT), hf_logits(odd, PROMPT))


def test_they_load_with_one_warning_and_the_same_logits(checkpoints: tuple[Path, Path]) -> None:
    plain, odd = checkpoints
    with pytest.warns(IgnoredConfigFieldWarning) as caught:
        model = load_checkpoint(odd)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert all(f"{key}={value!r}" in message for key, value in IGNORED.items())
    schedule = [[(0, len(PROMPT))]]
    odd_logits = run_schedule(model, [PROMPT], schedule)[0]
    assert torch.equal(odd_logits, run_schedule(load_checkpoint(plain), [PROMPT], schedule)[0])


def test_the_cli_prints_the_warning_as_one_line(
    checkpoints: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--platform", "cpu", "--checkpoint", str(checkpoints[1])]
    argv += ["--cudagraph-mode", "NONE"]  # a warning at load: no graph needed
    assert main([*argv, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--json"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dsv4 run: warning: config fields num_key_value_heads=4, ")
    assert line.endswith(
        "as transformers' DeepSeek-V4 ignores them (its model is the same whatever they say)"
    )
