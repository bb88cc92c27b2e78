"""``dsv4 matrix`` on a checkpoint written by transformers whose indexer ties: every allowed cell
equals eager.

The checkpoint is the tiny preset's config with one indexer head and ``index_topk=2`` (an entry
scores exactly 0.0 wherever that head's ReLU is zero, so ties straddle the cut in most rows),
initialised and saved by transformers itself (``initializer_range=0.1``). Its 40-token prompt
decodes at 3 blocks of context: eager attends 12 entries, the graphs their 16-token bucket's
16. With ``torch.topk`` (which breaks ties differently at the two widths) 21 of the 23 cells
mismatch, by up to 0.93 in the logits; with the tie rule every cell is equal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from dsv4.config import DeepseekV4Config
from dsv4.hf_config import config_to_hf_dict
from runners.cli.main import main


@pytest.fixture(scope="module")
def tying_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tying-checkpoint")
    fields = config_to_hf_dict(DeepseekV4Config.tiny())
    fields.update(index_n_heads=1, index_topk=2, initializer_range=0.1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**fields))
    hf.save_pretrained(directory)
    return directory


def test_every_allowed_cell_equals_eager_on_a_tying_transformers_checkpoint(
    tying_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(2)
    prompt = ",".join(str(rng.randrange(256)) for _ in range(40))
    argv = ["matrix", "--checkpoint", str(tying_checkpoint), "--platform", "cpu"]
    argv += ["--prompt-ids", prompt, "--max-new-tokens", "2", "--capture-sizes", "1"]
    argv += ["--first-context-bucket", "16", "--threads", "1", "--json"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["counts"] == {"refused": 17, "equal": 23}
    assert max(c["max_abs_diff"] for c in payload["cells"] if c["status"] == "equal") <= 5e-5
