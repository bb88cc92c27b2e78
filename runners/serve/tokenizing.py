"""The most text a prompt can have and still fit the model, known before any of it is encoded.

A text whose tokens can never fit ``max_model_len`` is refused by its size alone: encoding 16
MiB costs about 16 s of a core, and answering it as tokens more than that, for a prompt the
engine would refuse anyway.

Invariant: ``bytes_per_token(tokenizer)`` is a number ``B`` such that every token of every
encoding stands for at most ``B`` bytes of the UTF-8 text, so a text of more than ``B * N``
bytes has more than ``N`` tokens; or None where no such bound holds (a normalizer may shrink
the text, a pre-tokenizer may drop characters, an unknown-token rule may fuse runs, an added
token may swallow the spaces beside it, truncation may cut the encoding): such text is bounded
by the request body's size alone.
"""

from __future__ import annotations

import json
from typing import Any

from runners.text import ByteLevelTokenizer, Tokenizer

__all__ = ["bytes_per_token", "text_bytes"]

_SPLITTING = {"ByteLevel", "Split", "Digits", "Punctuation", "Metaspace", "UnicodeScripts"}
"""Pre-tokenizers that only cut the text (or, Metaspace, add to it): each keeps every byte."""
_UNKNOWN_CHARACTER_BYTES = 4
"""The most UTF-8 bytes one unknown character (one unknown token, without ``fuse_unk``) is."""


def text_bytes(text: str) -> int:
    """The UTF-8 length of ``text`` (its length for ASCII, without encoding it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most text bytes one token stands for, or None without a bound (module docstring)."""
    if isinstance(tokenizer, ByteLevelTokenizer):
        return 1
    config = json.loads(tokenizer.tokenizer.to_str())
    model = config.get("model") or {}
    if config.get("truncation") is not None:
        return None
    if config.get("normalizer") not in (None, {"type": "Sequence", "normalizers": []}):
        return None
    if not _keeps_every_byte(config.get("pre_tokenizer")):
        return None
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    added_tokens = config.get("added_tokens") or ()
    if any(t.get("lstrip") or t.get("rstrip") for t in added_tokens):
        return None  # such a token also stands for the whitespace beside it, however long
    byte_level = _is_byte_level(config.get("pre_tokenizer"))
    longest = max(
        (len(token) if byte_level else len(token.encode("utf-8")) for token in model["vocab"]),
        default=1,
    )
    added = max((len(t["content"].encode("utf-8")) for t in added_tokens), default=1)
    return max(longest, added, 1 if byte_level else _UNKNOWN_CHARACTER_BYTES)


def _keeps_every_byte(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _SPLITTING


def _is_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    """A ByteLevel pre-tokenizer maps each byte to one character of the vocabulary's alphabet,
    so a token's length in characters is the bytes it stands for."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return bool(pre_tokenizer.get("type") == "ByteLevel")
