"""What every route of one server shares: its settings, the model's tokenizer and limits, the
engine loop, the metrics, and the count of requests it has accepted.

Invariants:
- ``admit`` bounds the engine requests (choices) in flight to ``max_pending`` (the rows plus the
  queue the server allows): past it a request is refused with 503 and ``Retry-After`` before
  anything is queued; ``release`` gives a slot back when a choice ends, exactly once. A request
  of more choices than ``max_pending`` could never be admitted: ``check_choices`` refuses it
  with a 400 before any of its prompts is encoded (a 503 would have clients retry it forever).
- Prompts are encoded off the event loop, and the tokenizer releases the GIL while it works,
  so a long prompt never stalls other requests or ``/health``; a text over ``LARGE_TEXT_BYTES``
  is encoded on a thread of its own (one at a time), so large texts never hold every worker
  thread while short prompts wait.
- A text that can never fit is refused by its size before it is encoded: more than
  ``bytes_per_token * max_model_len`` UTF-8 bytes (``tokenizing``); a chat prompt is checked so
  once rendered, before it is encoded.
- A prompt is checked against the model before the engine sees it, so each refusal names the
  field it came from: token ids outside the vocabulary (the prompt), a prompt longer than
  ``max_model_len`` (the prompt), or one whose ``max_tokens`` would run past it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import attrs

from dsv4.tokenizer import CheckpointTokenizer
from runners.serve.engine_loop import EngineLoop
from runners.serve.errors import ApiError
from runners.serve.metrics import Metrics
from runners.serve.tokenizing import bytes_per_token, text_bytes
from runners.text import Tokenizer

T = TypeVar("T")

__all__ = ["ServerContext", "ServerSettings"]

RETRY_AFTER_S = 1
LARGE_TEXT_BYTES = 2**20
"""Texts longer than this (about a second of a core to encode) queue for one thread of their
own (module docstring)."""


@attrs.frozen(kw_only=True)
class ServerSettings:
    """The server's own options (the engine's are the ``EngineSpec``'s)."""

    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    max_pending: int = 256
    """Engine requests (choices) in flight at once; more are refused with 503."""
    created: int = attrs.field(factory=lambda: int(time.time()))


@attrs.define
class ServerContext:
    """The state the routes share (module docstring)."""

    settings: ServerSettings
    tokenizer: Tokenizer | None
    vocab_size: int
    loop: EngineLoop
    metrics: Metrics
    pending: int = 0
    bytes_per_token: int | None = attrs.field(init=False)
    _large_texts: concurrent.futures.ThreadPoolExecutor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.bytes_per_token = None if self.tokenizer is None else bytes_per_token(self.tokenizer)
        self._large_texts = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dsv4-large-text"
        )

    def close(self) -> None:
        """Stop the large-text thread once the server has ended (a text it encodes finishes)."""
        self._large_texts.shutdown(wait=False, cancel_futures=True)

    def check_choices(self, prompts: int, n: int) -> None:
        """Refuse (400) a request of more choices than the server ever holds at once."""
        limit = self.settings.max_pending
        if prompts * n <= limit:
            return
        field = "prompt" if prompts > limit else "n"
        raise ApiError(
            400,
            f"{field}: {prompts} prompt{'s' if prompts > 1 else ''} x n {n} = {prompts * n} "
            f"choices, more than this server ever holds at once ({limit}); send fewer",
            param=field,
        )

    def admit(self, count: int) -> None:
        if self.pending + count > self.settings.max_pending:
            raise ApiError(
                503,
                f"the server is full ({self.pending} requests in flight, at most "
                f"{self.settings.max_pending}); retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.pending += count

    def release(self, count: int = 1) -> None:
        self.pending -= count

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(
                404,
                f"the model {name[:80]!r} does not exist; this server serves "
                f"{self.settings.model_name!r}",
                param="model",
            )

    def require_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(
                400, f"{field}: this model has no tokenizer; send token ids", param=field
            )
        return self.tokenizer

    def check_text(self, text: str, field: str) -> None:
        """Refuse (400) a text with more bytes than ``max_model_len`` tokens can hold."""
        if self.bytes_per_token is None:
            return
        limit = self.bytes_per_token * self.settings.max_model_len
        size = text_bytes(text)
        if size > limit:
            raise ApiError(
                400,
                f"{field}: the text is {size} bytes, more than max_model_len "
                f"{self.settings.max_model_len} tokens can hold (a token of this tokenizer is "
                f"at most {self.bytes_per_token} bytes: at most {limit} bytes)",
                param=field,
            )

    async def _off_loop(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` on a worker thread: the large-text thread past ``LARGE_TEXT_BYTES``."""
        executor = self._large_texts if size > LARGE_TEXT_BYTES else None
        return await asyncio.get_running_loop().run_in_executor(executor, work)

    async def encode(self, text: str, field: str) -> list[int]:
        tokenizer = self.require_tokenizer(field)
        self.check_text(text, field)
        return await self._off_loop(text_bytes(text), functools.partial(tokenizer.encode, text))

    async def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        tokenizer = self.require_tokenizer("messages")
        if not isinstance(tokenizer, CheckpointTokenizer) or tokenizer.chat_template is None:
            raise ApiError(400, "messages: this model has no chat template", param="messages")
        size = sum(text_bytes(m["content"]) for m in messages)
        try:
            rendered = await self._off_loop(
                size, functools.partial(tokenizer.render_messages, messages)
            )
        except ValueError as exc:  # the template raised (TokenizerError): the messages' fault
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        self.check_text(rendered, "messages")
        return await self._off_loop(
            text_bytes(rendered), functools.partial(tokenizer.encode_rendered, rendered)
        )

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    async def decode_off_loop(self, ids: Sequence[int]) -> str:
        """``decode(ids)`` on a worker thread (the tokenizer releases the GIL as it decodes)."""
        return await self._off_loop(len(ids), functools.partial(self.decode, ids))

    def token_text(self, token: int) -> str:
        """A token's own text, for log-probabilities: its decoded text, or ``token_id:N`` when
        that is not a whole text of its own (part of a character's bytes, a special token, no
        tokenizer), so distinct tokens never share a name."""
        text = "" if self.tokenizer is None else self.tokenizer.decode([token])
        return text if text and "\ufffd" not in text else f"token_id:{token}"

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                param=field,
            )

    def check_length(self, prompt: Sequence[int], max_tokens: int, field: str) -> None:
        """Refuse a prompt (``field``) or a ``max_tokens`` that cannot fit ``max_model_len``."""
        limit = self.settings.max_model_len
        if len(prompt) > limit:
            raise ApiError(
                400,
                f"{field}: the prompt is {len(prompt)} tokens, more than max_model_len {limit}",
                param=field,
            )
        if len(prompt) + max_tokens - 1 > limit:
            raise ApiError(
                400,
                f"max_tokens: a prompt of {len(prompt)} tokens leaves room for at most "
                f"{limit - len(prompt) + 1} tokens (max_model_len {limit}), got {max_tokens}",
                param="max_tokens",
            )

    def default_max_tokens(self, prompt: Sequence[int]) -> int:
        """The rest of the context after ``prompt`` (chat's default)."""
        return max(1, self.settings.max_model_len - len(prompt) + 1)
