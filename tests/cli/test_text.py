"""The text path of ``dsv4 run`` (DESIGN §7-§8): a checkpoint's ``tokenizer.json`` encodes
``--prompt`` (``--chat`` through its chat template) and decodes each output to ``text``; the
built-in model stays byte-level; every ``eos_token_id`` of a list ends a request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from runners.cli.main import main

FAST = ["--cudagraph-mode", "NONE", "--threads", "1", "--platform", "cpu"]
"""Eager runs: text, tokens and stops are host-side (the README's tour runs the text path with
its graphs)."""
BOS = "<｜begin▁of▁sentence｜>"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> dict:
    assert main([*argv, "--json"]) == code
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return code, lines[0]


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_init_checkpoint_writes_a_tokenizer_transformers_reads_the_same(
    tiny_checkpoint: Path,
) -> None:
    from transformers import AutoTokenizer

    from dsv4.tokenizer import CheckpointTokenizer

    files = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    ours = CheckpointTokenizer.from_directory(tiny_checkpoint)
    assert ours is not None
    theirs = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    vocab = ours.tokenizer.get_vocab()
    assert max(vocab.values()) < config["vocab_size"] and len(vocab) == config["vocab_size"]
    assert theirs.bos_token_id == config["bos_token_id"]
    assert theirs.eos_token_id == config["eos_token_id"]
    assert theirs.pad_token_id == config["pad_token_id"]
    for text in ["Hello, world!", "the answer is in the text", "héllo 日本 ☃\n\tx", " ", "a<b>"]:
        ids = ours.encode(text)
        assert ids[0] == config["bos_token_id"]
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    message = [{"role": "user", "content": "Hi there"}]
    rendered = theirs.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat("Hi there") == rendered
    assert ours.encode_chat("Hi there") == theirs.apply_chat_template(
        message, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    odd = [5, 200, 319, 256, 257, 258]  # a byte, a lone continuation byte, a merge, specials
    assert ours.decode(odd) == theirs.decode(odd, skip_special_tokens=True)


def test_prompt_text_is_encoded_and_outputs_decoded_by_the_checkpoint_tokenizer(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--prompt", "Hello, world", *FAST]
    payload = _json(capsys, [*argv, "--max-new-tokens", "6", "--ignore-eos"])
    (out,) = payload["outputs"]
    assert out["prompt_ids"] == tokenizer.encode("Hello, world").ids
    assert out["prompt_ids"][0] == 256 and len(out["prompt_ids"]) < 13, "BOS, then merges"
    assert len(out["output_ids"]) == 6
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert payload["byte_level"] is False
    ids = _json(
        capsys, ["run", "--checkpoint", str(tiny_checkpoint), "--prompt-ids", "5,6,7", *FAST]
    )
    assert ids["outputs"][0]["text"] == tokenizer.decode(
        ids["outputs"][0]["output_ids"], skip_special_tokens=True
    ), "token-id prompts are decoded too"
    assert main([*argv, "--max-new-tokens", "6", "--ignore-eos"]) == 0
    assert f"    text   {out['text']!r}" in capsys.readouterr().out.splitlines()


def test_chat_applies_the_template(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--chat", "--prompt", "Hi", *FAST]
    (out,) = _json(capsys, [*argv, "--max-new-tokens", "3"])["outputs"]
    rendered = f"{BOS}<｜User｜>Hi<｜Assistant｜>"
    assert out["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False).ids
    assert out["prompt_ids"] == [256, 259, 72, 105, 260]
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_chat_without_a_template_is_refused_with_exit_2(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _edit_json(ckpt / "tokenizer_config.json", chat_template=None)
    code, line = _error(capsys, ["run", "--checkpoint", str(ckpt), "--chat", "--prompt", "Hi"])
    assert code == 2 and "--chat" in line and "tokenizer_config.json" in line
    code, line = _error(capsys, ["run", "--chat", "--prompt", "Hi", *FAST])
    assert code == 2 and "--chat" in line and "built-in model" in line
    code, line = _error(capsys, ["run", "--checkpoint", str(ckpt), "--chat", "--prompt-ids", "1"])
    assert code == 2 and "--chat" in line and "--prompt TEXT" in line


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", '{"model": {"type": "Nonsense"}}'),
        ("tokenizer_config.json", "[1, 2"),
        ("generation_config.json", "{oops"),
    ],
)
def test_a_broken_tokenizer_file_is_one_line_naming_it(
    ckpt: Path, capsys: pytest.CaptureFixture[str], name: str, content: str
) -> None:
    (ckpt / name).write_text(content)
    code, line = _error(capsys, ["run", "--checkpoint", str(ckpt), "--prompt", "Hi", *FAST])
    assert code == 1
    assert line.startswith("dsv4 run: error: ") and str(ckpt / name) in line


@pytest.mark.parametrize("eos", [["x"], [257, True]])
def test_a_bad_eos_token_id_is_one_line_naming_config_json(
    ckpt: Path, capsys: pytest.CaptureFixture[str], eos: object
) -> None:
    _edit_json(ckpt / "config.json", eos_token_id=eos)
    code, line = _error(capsys, ["run", "--checkpoint", str(ckpt), "--prompt-ids", "1", *FAST])
    assert code == 1 and "config.json" in line and "eos_token_id" in line


@pytest.mark.parametrize(
    "where", ["config-first", "config-second", "generation-config", "generation-config-int"]
)
def test_every_listed_eos_id_stops_a_request(
    ckpt: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    argv = ["run", "--checkpoint", str(ckpt), "--prompt-ids", "5,6,7", *FAST]
    free = _json(capsys, [*argv, "--max-new-tokens", "6", "--ignore-eos"])["outputs"][0]
    first, second = free["output_ids"][:2]  # greedy: the same on every run
    stop = second if where == "config-second" else first
    expected = free["output_ids"][: free["output_ids"].index(stop) + 1]
    if where == "config-first":
        _edit_json(ckpt / "config.json", eos_token_id=[first, 258])
    elif where == "config-second":
        _edit_json(ckpt / "config.json", eos_token_id=[258, second])
    elif where == "generation-config":
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, first]}))
    else:
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    (out,) = _json(capsys, [*argv, "--max-new-tokens", "6"])["outputs"]
    assert out["output_ids"] == expected and out["finish_reason"] == "stop"
    (out,) = _json(capsys, [*argv, "--max-new-tokens", "6", "--ignore-eos"])["outputs"]
    assert out["output_ids"] == free["output_ids"] and out["finish_reason"] == "length"


def test_the_built_in_model_stays_byte_level(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--prompt", "hi", "--max-new-tokens", "3", "--ignore-eos", *FAST]
    payload = _json(capsys, argv)
    (out,) = payload["outputs"]
    assert out["prompt_ids"] == list(b"hi") and "text" not in out
    assert payload["byte_level"] is True
    assert main(argv) == 0
    assert "    text   'hi' -> " in capsys.readouterr().out


def test_a_prompt_that_is_not_utf8_is_a_usage_error_for_a_tokenizer_and_bytes_without(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typed = b"hi \xff\xfe".decode("utf-8", errors="surrogateescape")  # as Python gets argv
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--prompt", typed, *FAST]
    code, line = _error(capsys, argv)
    assert code == 2
    assert line.startswith("dsv4 run: error: --prompt is not UTF-8 text (byte 0xff at offset 3)")
    argv = ["run", "--prompt", typed, "--max-new-tokens", "1", *FAST]
    assert _json(capsys, argv)["outputs"][0]["prompt_ids"] == list(b"hi \xff\xfe")


def test_a_checkpoint_without_a_tokenizer_stays_byte_level(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt / "tokenizer.json").unlink()
    argv = ["run", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2", *FAST]
    payload = _json(capsys, argv)
    assert payload["outputs"][0]["prompt_ids"] == list(b"hi") and payload["byte_level"] is True
    assert "text" not in payload["outputs"][0]


def test_text_streams_to_a_terminal(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--prompt", "Hello", "--prompt", "The"]
    argv += ["--max-new-tokens", "5", "--ignore-eos", *FAST]
    texts = [o["text"] for o in _json(capsys, argv)["outputs"]]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[0] {texts[0]}\n[1] {texts[1]}\n"), "streamed in prompt order"
    assert "\n    text   " not in out, "the text is not printed twice"
