"""The random checkpoint's tokenizer: special tokens at the config's ids, bytes in byte order at
the lowest remaining ids, every id in the vocabulary, any text round-trips, and transformers reads
the files to the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4.config import DeepseekV4Config
from dsv4.tokenizer import CheckpointTokenizer
from dsv4.toy_tokenizer import build_toy_tokenizer, save_toy_tokenizer

TINY = DeepseekV4Config.tiny()
TOKENIZER = build_toy_tokenizer(TINY)


def test_the_presets_bytes_are_the_built_in_byte_ids() -> None:
    for b in (0, 32, 65, 255):
        assert TOKENIZER.decode([b]) == bytes([b]).decode("utf-8", errors="replace")
    assert TOKENIZER.token_to_id("<｜begin▁of▁sentence｜>") == TINY.bos_token_id
    assert TOKENIZER.token_to_id("<｜end▁of▁sentence｜>") == TINY.eos_token_id
    assert TOKENIZER.token_to_id("<｜▁pad▁｜>") == TINY.pad_token_id
    assert sorted(TOKENIZER.get_vocab().values()) == list(range(TINY.vocab_size))


@given(st.text(max_size=40))
def test_any_text_round_trips(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < TINY.vocab_size for i in ids)
    assert TOKENIZER.decode(ids, skip_special_tokens=True) == text


def test_declared_ids_anywhere_and_a_list_of_eos_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = attrs.evolve(TINY, bos_token_id=0, eos_token_id=(1, 300), pad_token_id=None)
    tokenizer = build_toy_tokenizer(config)
    assert tokenizer.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert tokenizer.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert tokenizer.id_to_token(300) is not None
    assert tokenizer.encode("A", add_special_tokens=False).ids == [ord("A") + 2]
    assert max(tokenizer.get_vocab().values()) < config.vocab_size
    save_toy_tokenizer(tmp_path, config)
    ours = CheckpointTokenizer.from_directory(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours is not None and theirs.bos_token_id == 0 and theirs.eos_token_id == 1
    assert ours.encode("Hello there") == theirs.encode("Hello there")
    assert ours.encode("Hello there")[0] == 0


def test_a_vocabulary_too_small_for_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        build_toy_tokenizer(attrs.evolve(TINY, vocab_size=259, pad_token_id=None))
