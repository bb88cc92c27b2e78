"""The text side of an engine: the tokenizer its prompts and outputs are read and written with.

One rule, shared by ``dsv4 run``, ``dsv4 serve`` and ``build_engine``: a checkpoint with a
``tokenizer.json`` uses it (``CheckpointTokenizer``); the built-in model, and a checkpoint
without one, are byte-level when their vocabulary holds every byte (token ``b < 256`` is byte
``b``, ids from 256 up are special and have no text); otherwise there is no tokenizer and only
token ids go in and out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from dsv4.tokenizer import CheckpointTokenizer

__all__ = ["BYTE_VOCABULARY", "ByteLevelTokenizer", "Tokenizer", "tokenizer_of"]

BYTE_VOCABULARY = 256
"""The smallest vocabulary that is byte-level: one token per byte value."""


class ByteLevelTokenizer:
    """Text as UTF-8 bytes, one token each (the built-in model's vocabulary); no chat template."""

    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: special ids (>= 256) skipped, invalid UTF-8 replaced."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCABULARY).decode("utf-8", errors="replace")

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        raise ValueError("a byte-level vocabulary has no chat template")


Tokenizer = CheckpointTokenizer | ByteLevelTokenizer


def tokenizer_of(checkpoint: Path | None, vocab_size: int) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (None: the built-in model) with ``vocab_size``
    tokens, by the module's rule; a broken ``tokenizer.json`` is a ``TokenizerError``."""
    tokenizer = CheckpointTokenizer.from_directory(checkpoint) if checkpoint is not None else None
    if tokenizer is not None:
        return tokenizer
    return ByteLevelTokenizer() if vocab_size >= BYTE_VOCABULARY else None
