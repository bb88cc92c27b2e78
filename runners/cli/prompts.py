"""``dsv4 run``'s prompts as token ids, and the text of token ids.

Invariants:
- ``--prompt-ids`` prompts come first, as given, then ``--prompt`` texts, in the order typed.
- With a checkpoint tokenizer (``tokenizer.json``), text is encoded by it (``--chat``: through
  its chat template) and every output can be decoded; without one, text is byte-level (token
  ``b < 256`` is byte ``b``, the built-in model's vocabulary) and ``--chat`` is refused.
- Bad usage (no prompt, an empty one, ``--chat`` without text or without a template, text that
  is not UTF-8 for a checkpoint tokenizer) is a ``UsageError``; a broken tokenizer file is a
  ``TokenizerError`` naming it. Byte-level text is the bytes typed, UTF-8 or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dsv4.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, CheckpointTokenizer
from runners.cli.errors import UsageError

__all__ = ["byte_level_text", "check_prompt_flags", "encode_prompts", "load_tokenizer"]


def byte_level_text(ids: Sequence[int]) -> str:
    """The text of byte-level token ids (ids >= 256 are special tokens and skipped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def check_prompt_flags(
    prompt_ids: Sequence[Sequence[int]] | None, texts: Sequence[str] | None, *, chat: bool
) -> None:
    """Refuse prompt flags that cannot make a request, before anything is loaded."""
    if any(not text for text in texts or ()):
        raise UsageError("--prompt is empty: give at least one character")
    if not prompt_ids and not texts:
        raise UsageError("no prompt given: use --prompt TEXT or --prompt-ids 1,2,3")
    if chat and not texts:
        raise UsageError("--chat applies a chat template to --prompt TEXT; none was given")


def load_tokenizer(checkpoint: Path | None, *, chat: bool) -> CheckpointTokenizer | None:
    """The checkpoint's tokenizer (None without ``tokenizer.json`` or without a checkpoint);
    ``chat``: refuse, as bad usage, a model with no chat template."""
    if chat and checkpoint is not None and not checkpoint.is_dir():  # not a --chat problem
        raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
    tokenizer = CheckpointTokenizer.from_directory(checkpoint) if checkpoint else None
    if chat and tokenizer is None:
        where = f"{checkpoint} has no {TOKENIZER_FILE}" if checkpoint else "the built-in model"
        raise UsageError(f"--chat needs a checkpoint tokenizer with a chat template; {where}")
    if chat and tokenizer is not None and tokenizer.chat_template is None:
        raise UsageError(
            f"--chat needs a chat template; {tokenizer.directory / TOKENIZER_CONFIG_FILE} "
            "has no chat_template"
        )
    return tokenizer


def _typed_bytes(text: str) -> bytes:
    """The bytes of ``text`` as typed: Python hands a command line's bytes that are not UTF-8
    over as lone surrogates (``surrogateescape``), which turn back into those bytes here."""
    try:
        return text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        raise UsageError("--prompt holds characters that are not text (lone surrogates)") from None


def encode_prompts(
    prompt_ids: Sequence[Sequence[int]] | None,
    texts: Sequence[str] | None,
    tokenizer: CheckpointTokenizer | None,
    *,
    chat: bool,
) -> list[list[int]]:
    """Every prompt as token ids (see the module docstring for the order and the encoding)."""
    prompts = [list(ids) for ids in prompt_ids or ()]
    for text in texts or ():
        typed = _typed_bytes(text)
        if tokenizer is None:
            prompts.append(list(typed))
            continue
        try:
            typed.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise UsageError(
                f"--prompt is not UTF-8 text (byte 0x{typed[bad.start]:02x} at offset "
                f"{bad.start}); the checkpoint's tokenizer encodes text: give UTF-8, or token "
                "ids with --prompt-ids"
            ) from None
        if chat:
            prompts.append(tokenizer.encode_chat(text))
        else:
            prompts.append(tokenizer.encode(text))
    return prompts
