"""The requests the server accepts, as pydantic models mirroring OpenAI's (and vLLM's extra
sampling fields): the published OpenAPI schema is generated from these, so it is the contract
the fuzzer tests.

Invariants:
- Strict and closed: a field of the wrong JSON type (``"1"`` for an int, ``1`` for a bool),
  a number out of range, NaN or infinity, or a field this server does not implement (OpenAI's
  ``logit_bias``, ``suffix``, ``tools``, ...) fails validation and becomes a 400 naming it;
  nothing a client sends is silently ignored (``user`` is accepted: it only labels a request).
- Every bound the engine would refuse is already in the schema where it is static (ranges,
  lengths); what depends on the model (prompt length, vocabulary) is checked by the engine and
  is a 400 too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from runners.engine.params import MAX_LOGPROBS, MAX_STOP_STRINGS

__all__ = [
    "MAX_CHOICES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "SamplingRequest",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
]

MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on ``logprobs`` of ``/v1/completions``."""
MAX_SEED = 2**63 - 1 - MAX_CHOICES

TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
StopStrings = Annotated[list[Text], Field(min_length=1, max_length=MAX_STOP_STRINGS)]


class Strict(BaseModel):
    """Closed, strictly typed, finite numbers (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    """Send one more chunk before ``[DONE]``, with ``"choices": []`` and the usage."""


class SamplingRequest(Strict):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    """Default 1.0 (OpenAI's); 0 is greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """0 or -1: off."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: Text | StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    skip_special_tokens: Literal[True] = True
    """Special tokens never appear in text (``false`` is not supported)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt as text, token ids, or a list of either."""

    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    echo: bool = False
    """Prefix each choice's text with its prompt's."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Takes precedence over ``max_tokens``; without either, the rest of the context."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeRequest(Strict):
    """``POST /tokenize``: text (``prompt``) or messages, as the completion routes encode them."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids to text."""

    model: str
    tokens: list[TokenId]
