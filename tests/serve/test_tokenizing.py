"""``bytes_per_token``: a text of more than ``B * N`` UTF-8 bytes has more than ``N`` tokens (so
the server refuses it unencoded), checked on the toy checkpoint's tokenizer for any text; and no
bound (None) for every tokenizer feature that can make one token stand for more text."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from dsv4.tokenizer import CheckpointTokenizer
from runners.serve.tokenizing import bytes_per_token, text_bytes
from runners.text import ByteLevelTokenizer

VALID_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)
"""Any valid Unicode (the schema refuses lone surrogates before a tokenizer sees them)."""
RUNS = st.builds(lambda piece, count: piece * count, VALID_TEXT, st.integers(1, 50))
"""Repeated pieces: long runs of one character are where merges make the longest tokens."""


@pytest.fixture(scope="module")
def toy(checkpoint: Path) -> CheckpointTokenizer:
    tokenizer = CheckpointTokenizer.from_directory(checkpoint)
    assert tokenizer is not None
    return tokenizer


def test_the_toy_tokenizer_has_a_bound_no_smaller_than_its_longest_token(
    toy: CheckpointTokenizer,
) -> None:
    bound = bytes_per_token(toy)
    assert bound is not None
    vocabulary = toy.tokenizer.get_vocab(with_added_tokens=True)
    longest = max(
        len(toy.tokenizer.decode([i], skip_special_tokens=False).encode())
        for i in vocabulary.values()
    )
    assert bound >= longest


@given(text=st.one_of(VALID_TEXT, RUNS))
def test_no_text_has_more_bytes_than_its_tokens_can_hold(
    toy: CheckpointTokenizer, text: str
) -> None:
    bound = bytes_per_token(toy)
    assert bound is not None
    assert text_bytes(text) == len(text.encode("utf-8"))
    assert text_bytes(text) <= bound * len(toy.encode(text))


def test_byte_level_is_one_byte_a_token() -> None:
    assert bytes_per_token(ByteLevelTokenizer()) == 1


def _edited(
    toy: CheckpointTokenizer, edit: Callable[[dict[str, Any]], None]
) -> CheckpointTokenizer:
    config = json.loads(toy.tokenizer.to_str())
    edit(config)
    edited = copy.copy(toy)
    edited.tokenizer = RustTokenizer.from_str(json.dumps(config))
    return edited


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.__setitem__(key, value)


def _strip_added_spaces(config: dict[str, Any]) -> None:
    config["added_tokens"][0]["lstrip"] = True


def _fuse_unknown(config: dict[str, Any]) -> None:
    config["model"]["fuse_unk"] = True


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        (
            "a normalizer (Strip drops any run of spaces)",
            _set("normalizer", {"type": "Strip", "strip_left": True, "strip_right": True}),
        ),
        (
            "a pre-tokenizer that removes what it splits",
            _set(
                "pre_tokenizer",
                {
                    "type": "Split",
                    "pattern": {"String": " "},
                    "behavior": "Removed",
                    "invert": False,
                },
            ),
        ),
        (
            "truncation",
            _set(
                "truncation",
                {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
            ),
        ),
        ("an added token that swallows the spaces beside it", _strip_added_spaces),
        ("unknown characters fused into one token", _fuse_unknown),
    ],
)
def test_no_bound_where_a_token_can_stand_for_any_amount_of_text(
    toy: CheckpointTokenizer, name: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    assert bytes_per_token(_edited(toy, edit)) is None


def test_a_stripping_normalizer_really_breaks_a_byte_bound(toy: CheckpointTokenizer) -> None:
    """Why the normalizer case has no bound: 10,000 spaces and one letter are one token."""
    stripping = _edited(
        toy, _set("normalizer", {"type": "Strip", "strip_left": True, "strip_right": True})
    )
    text = " " * 10_000 + "a"
    assert len(stripping.tokenizer.encode(text, add_special_tokens=False).ids) == 1
