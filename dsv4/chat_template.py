"""Rendering a checkpoint's chat template the way transformers' ``apply_chat_template`` does.

Invariants:
- The template runs in jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension, and the globals and filters transformers provides
  (``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML), so a template
  written for transformers renders to the same string here.
- The template sees ``messages``, ``add_generation_prompt``, ``tools=None``, ``documents=None``
  and the tokenizer's special tokens as strings (``bos_token``, ``eos_token``, ...).
- Every failure (a template that does not compile, ``raise_exception``, an undefined call) is a
  ``ChatTemplateError`` with a one-line message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from graphs.errors import InputError

__all__ = ["ChatTemplateError", "render_chat_template"]


class ChatTemplateError(InputError, ValueError):
    """The chat template does not compile or fails while rendering."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
) -> str:
    """``template`` rendered for ``messages`` (see the module docstring for what it sees)."""
    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            **special_tokens,
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
