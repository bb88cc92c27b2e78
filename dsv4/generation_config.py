"""The token ids that end generation: ``eos_token_id`` of ``config.json`` and of
``generation_config.json``.

Published checkpoints give ``eos_token_id`` as one id or a list of ids (any of which ends a
reply), in ``config.json``, in ``generation_config.json`` or in both.

Invariants:
- ``stop_token_ids`` returns ``config.json``'s ids first, in their order, then those of
  ``generation_config.json`` not already listed; no id twice. Generation stops at any of them.
- Every id is an int; anything else (a string, a bool, a file that does not parse) is a
  ``GenerationConfigError`` whose one-line message names the file.
- An id outside ``[0, vocab_size)`` (negative or too large) is accepted with one
  ``OutOfVocabularyEosWarning`` naming the file, as transformers accepts it, and dropped: no
  token has it, so it could never stop a request.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from graphs.errors import InputError

__all__ = [
    "GENERATION_CONFIG_FILE",
    "GenerationConfigError",
    "OutOfVocabularyEosWarning",
    "eos_ids",
    "stop_token_ids",
]

GENERATION_CONFIG_FILE = "generation_config.json"


class GenerationConfigError(InputError, ValueError):
    """An ``eos_token_id`` that is not a token id, or a generation config that does not parse."""


class OutOfVocabularyEosWarning(UserWarning):
    """An ``eos_token_id`` no token of the vocabulary has: it never stops a request."""


def eos_ids(value: object, *, source: str, vocab_size: int) -> tuple[int, ...]:
    """``value`` (None, an id, or a list or tuple of ids) as a tuple of its ids in the
    vocabulary (those outside it are dropped with a warning)."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, list | tuple) else [value]
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise GenerationConfigError(
                f"{source}: eos_token_id must be a token id or a list of them, got {value!r}"
            )
        if not 0 <= item < vocab_size:
            warnings.warn(
                OutOfVocabularyEosWarning(
                    f"{source}: eos_token_id {item} is outside the vocabulary [0, {vocab_size}) "
                    "and never stops a request (transformers accepts it too)"
                ),
                stacklevel=2,
            )
            continue
        ids.append(item)
    return tuple(ids)


def _generation_eos(directory: Path, vocab_size: int) -> tuple[int, ...]:
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return ()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: cannot read generation config: {exc}") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return eos_ids(raw.get("eos_token_id"), source=str(path), vocab_size=vocab_size)


def stop_token_ids(
    config_eos: object, checkpoint: Path | None, *, vocab_size: int
) -> tuple[int, ...]:
    """Every id that ends generation (see the module docstring); ``config_eos`` is the loaded
    config's ``eos_token_id``, ``checkpoint`` the directory (None for a built-in model)."""
    source = str(checkpoint / "config.json") if checkpoint is not None else "model config"
    ids = list(eos_ids(config_eos, source=source, vocab_size=vocab_size))
    if checkpoint is not None:
        ids += [i for i in _generation_eos(checkpoint, vocab_size) if i not in ids]
    return tuple(dict.fromkeys(ids))
