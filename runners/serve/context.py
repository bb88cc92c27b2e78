"""What every route of one server shares: its settings, the model's tokenizer and limits, the
engine loop, the metrics, and the count of requests it has accepted.

Invariants:
- ``admit`` bounds the engine requests (choices) in flight to ``max_pending`` (the rows plus the
  queue the server allows): past it a request is refused with 503 and ``Retry-After`` before
  anything is queued; ``release`` gives a slot back when a choice ends, exactly once.
- Prompts are encoded off the event loop (``asyncio.to_thread``): a long prompt or a chat
  template never stalls other requests' streams.
- A prompt is checked against the model before the engine sees it, so each refusal names the
  field it came from: token ids outside the vocabulary (the prompt), a prompt longer than
  ``max_model_len`` (the prompt), or one whose ``max_tokens`` would run past it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

import attrs

from runners.serve.engine_loop import EngineLoop
from runners.serve.errors import ApiError
from runners.serve.metrics import Metrics
from runners.text import Tokenizer

__all__ = ["ServerContext", "ServerSettings"]

RETRY_AFTER_S = 1


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

    async def encode(self, text: str, field: str) -> list[int]:
        tokenizer = self.require_tokenizer(field)
        return await asyncio.to_thread(tokenizer.encode, text)

    async def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        tokenizer = self.require_tokenizer("messages")
        if tokenizer.chat_template is None:
            raise ApiError(400, "messages: this model has no chat template", param="messages")
        try:
            return await asyncio.to_thread(tokenizer.encode_messages, messages)
        except ValueError as exc:  # the template raised (TokenizerError): the messages' fault
            raise ApiError(400, f"messages: {exc}", param="messages") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

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
