"""An ``eos_token_id`` outside the vocabulary is accepted with one warning line, as transformers
accepts it, and never stops a request: the run is the one without that id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from dsv4.generation_config import OutOfVocabularyEosWarning, eos_ids
from runners.cli.main import main

FAST = ["--cudagraph-mode", "NONE", "--threads", "1", "--platform", "cpu"]  # stops: host-side
VOCAB = 320
"""The tiny preset's vocabulary."""


def test_ids_outside_the_vocabulary_are_dropped_with_a_warning() -> None:
    with pytest.warns(OutOfVocabularyEosWarning) as caught:
        assert eos_ids([257, VOCAB, -1, 258], source="config.json", vocab_size=VOCAB) == (257, 258)
    assert [str(w.message) for w in caught] == [
        f"config.json: eos_token_id {bad} is outside the vocabulary [0, {VOCAB}) and never stops "
        "a request (transformers accepts it too)"
        for bad in (VOCAB, -1)
    ]


def _edit(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize(
    ("file", "eos", "bad"),
    [("config.json", [257, 9999], 9999), ("generation_config.json", -1, -1)],
)
def test_the_run_warns_once_and_stops_as_without_the_id(
    ckpt: Path, capsys: pytest.CaptureFixture[str], file: str, eos: object, bad: int
) -> None:
    argv = ["run", "--checkpoint", str(ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "6"]
    assert main([*argv, *FAST, "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["outputs"]
    _edit(ckpt / file, eos_token_id=eos)
    loader = (
        transformers.GenerationConfig if file.startswith("generation") else transformers.AutoConfig
    )
    assert loader.from_pretrained(ckpt).eos_token_id == eos  # transformers accepts it
    assert main([*argv, *FAST, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["outputs"] == expected
    assert captured.err == (
        f"dsv4 run: warning: {ckpt / file}: eos_token_id {bad} is outside the vocabulary "
        f"[0, {VOCAB}) and never stops a request (transformers accepts it too)\n"
    )
