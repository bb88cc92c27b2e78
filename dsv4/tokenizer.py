"""A checkpoint's tokenizer: ``tokenizer.json`` with the options of ``tokenizer_config.json``.

Encodes and decodes as transformers' ``AutoTokenizer.from_pretrained(directory)`` does for a
``tokenizer.json``-backed tokenizer, with the ``tokenizers`` library alone.

Invariants:
- ``encode(text)``: when ``tokenizer_config.json`` sets ``add_bos_token`` or ``add_eos_token``,
  the ids are ``[bos]? + ids(text) + [eos]?`` by those flags (transformers rebuilds the
  post-processor so); otherwise the post-processor of ``tokenizer.json`` decides.
- ``encode_chat(text)``: the chat template rendered for one user message with a generation
  prompt, encoded without added special tokens (the template writes them), as
  ``apply_chat_template(..., tokenize=True)``.
- ``decode(ids)`` skips special tokens and ids the tokenizer does not know (a model's vocabulary
  is often padded beyond its tokenizer's).
- Every problem with the files is a ``TokenizerError`` whose one-line message names the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dsv4.chat_template import ChatTemplateError, render_chat_template
from graphs.errors import InputError

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "SPECIAL_TOKEN_KEYS",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "CheckpointTokenizer",
    "TokenizerError",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers 5 saves a chat template (used when tokenizer_config.json has none)."""
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerError(InputError, ValueError):
    """A tokenizer file is missing, does not parse, or contradicts itself (one line)."""


def _token_string(value: Any, key: str, source: Path) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TokenizerError(f"{source}: {key} must be a string or {{'content': ...}}, got {value!r}")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read tokenizer config: {exc}") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _chat_template(config: Mapping[str, Any], directory: Path, source: Path) -> str | None:
    """The default chat template: ``chat_template`` (a string, or a list of named templates
    whose ``default`` is taken), else ``chat_template.jinja``; None when there is none."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: chat_template must be a string, got {template!r:.60}")
    if template is None and (directory / CHAT_TEMPLATE_FILE).is_file():
        try:
            template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{directory / CHAT_TEMPLATE_FILE}: cannot read: {exc}") from None
    return template or None


def _flag(config: Mapping[str, Any], key: str, source: Path) -> bool | None:
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise TokenizerError(f"{source}: {key} must be true or false, got {value!r}")


class CheckpointTokenizer:
    """A checkpoint's tokenizer (see the module docstring for the encoding rules)."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], directory: Path) -> None:
        """``config`` is the parsed ``tokenizer_config.json`` (``{}`` without one)."""
        self.tokenizer = tokenizer
        self.directory = directory
        source = directory / TOKENIZER_CONFIG_FILE
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            token = _token_string(config.get(key), key, source)
            if token is not None:
                self.special_tokens[key] = token
        self.chat_template = _chat_template(config, directory, source)
        add_bos = _flag(config, "add_bos_token", source)
        add_eos = _flag(config, "add_eos_token", source)
        self._rebuild_specials = "add_bos_token" in config or "add_eos_token" in config
        self._prefix = self._special_ids("bos_token", source) if add_bos else []
        self._suffix = self._special_ids("eos_token", source) if add_eos else []
        cleanup = _flag(config, "clean_up_tokenization_spaces", source)
        # transformers skips this clean-up for BPE models (it would corrupt their output)
        self._clean_up = bool(cleanup) and type(tokenizer.model).__name__ != "BPE"

    @classmethod
    def from_directory(cls, directory: str | Path) -> CheckpointTokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no ``tokenizer.json``."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception for any bad file
            raise TokenizerError(f"{path}: cannot parse tokenizer: {exc}") from None
        return cls(tokenizer, _read_config(directory / TOKENIZER_CONFIG_FILE), directory)

    def _special_ids(self, key: str, source: Path) -> list[int]:
        token = self.special_tokens.get(key)
        if token is None:  # transformers drops add_bos/add_eos_token when the token is unset
            return []
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{source}: {key} {token!r} is not a token of {self.directory / TOKENIZER_FILE}"
            )
        return [token_id]

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, with the special tokens the tokenizer adds to a prompt."""
        if self._rebuild_specials:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            return [*self._prefix, *ids, *self._suffix]
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, text: str) -> str:
        """The chat template rendered for one user message ``text``, ready for a reply.

        Raises ``TokenizerError`` when there is no template or it fails."""
        return self.render_messages([{"role": "user", "content": text}])

    def render_messages(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat template rendered for a conversation, ready for the assistant's reply
        (``add_generation_prompt``). Raises ``TokenizerError`` when there is no template or it
        fails."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.directory / TOKENIZER_CONFIG_FILE} has no chat_template")
        try:
            return render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt=True,
                special_tokens=self.special_tokens,
            )
        except ChatTemplateError as exc:
            raise TokenizerError(f"{self.directory / TOKENIZER_CONFIG_FILE}: {exc}") from None

    def encode_chat(self, text: str) -> list[int]:
        """``render_chat(text)`` as token ids (no special tokens added: the template has them)."""
        return self.encode_messages([{"role": "user", "content": text}])

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """``render_messages(messages)`` as token ids, as ``apply_chat_template(messages,
        add_generation_prompt=True, tokenize=True)``."""
        return self.encode_rendered(self.render_messages(messages))

    def encode_rendered(self, rendered: str) -> list[int]:
        """A rendered chat prompt (``render_messages``) as token ids: no special tokens added
        (the template wrote them)."""
        return list(self.tokenizer.encode(rendered, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens and unknown ids skipped."""
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return _clean_up(text) if self._clean_up else text


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and contractions)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
