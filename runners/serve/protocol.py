"""The requests the server accepts, as pydantic models mirroring OpenAI's (and vLLM's extra
sampling fields): the published OpenAPI schema is generated from these, so it is the contract
the fuzzer tests.

Invariants:
- Strict and closed: a field of the wrong JSON type (``"1"`` for an int, ``1`` for a bool),
  a number out of range, NaN or infinity, or a field this server does not implement (OpenAI's
  ``logit_bias``, ``suffix``, ``tools``, ...) fails validation and becomes a 400 naming it;
  nothing a client sends is silently ignored (``user`` is accepted: it only labels a request).
- Every string is valid Unicode: a JSON ``\\udfff`` escape decodes to a lone surrogate, which no
  tokenizer, template or response can encode, so it is a 400 naming the field here.
- Every bound the engine would refuse is already in the schema where it is static (ranges,
  lengths, and the counts that bound a request's work before any of it runs: prompts,
  messages, content parts, stop strings, stop token ids); what depends on the model or the
  server (prompt length, vocabulary, the requests it can hold) is checked before encoding and
  is a 400 too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from runners.engine.params import MAX_LOGPROBS, MAX_STOP_STRINGS

__all__ = [
    "MAX_CHOICES",
    "MAX_CONTENT_PARTS",
    "MAX_DETOKENIZE_TOKENS",
    "MAX_MESSAGES",
    "MAX_PROMPTS",
    "MAX_STOP_TOKEN_IDS",
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
MAX_PROMPTS = 2048
"""The most prompts one completion request may list (the server may hold fewer at once)."""
MAX_MESSAGES = 4096
"""The most messages one chat request (or ``/tokenize``) may send."""
MAX_CONTENT_PARTS = 256
"""The most content parts one message may have."""
MAX_STOP_TOKEN_IDS = 1024
MAX_DETOKENIZE_TOKENS = 2**20
"""The most token ids one ``/detokenize`` may send (a million-token context)."""


def _unicode(value: str) -> str:
    """``value``, refused when it holds a lone surrogate (module docstring)."""
    if value.isascii():  # constant time for CPython's compact strings
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "is not valid Unicode: a lone surrogate {character} at character {position}",
            {"character": f"\\u{ord(value[exc.start]):04x}", "position": exc.start},
        ) from None
    return value


Str = Annotated[str, AfterValidator(_unicode)]
"""Any string of a request: valid Unicode (module docstring)."""
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
StopStrings = Annotated[list[Text], Field(min_length=1, max_length=MAX_STOP_STRINGS)]


def _shape(value: Any) -> str | None:
    """The tag of the union branch a JSON value's shape selects: ``"a text"`` for a string,
    else a list's by its first item (an empty list is ``"token ids"``, which refuses it);
    None for anything else."""
    if isinstance(value, str):
        return "a text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list of texts"
    if isinstance(first, list):
        return "token id lists"
    if isinstance(first, dict):
        return "text parts"
    return "token ids"


def by_shape(expected: str) -> Discriminator:
    """The discriminator of a union validated by the one branch the value's shape selects
    (``_shape``, each branch tagged with its shape): a value gets the errors of the branch it
    was meant for, once (``stop`` of 5,000 strings: "at most 16 items", not "should be a valid
    string"), and no other branch's work. The tags hold spaces, so an error's ``param`` leaves
    them out (``errors._field``); a shape no branch has "should be ``expected``"."""
    return Discriminator(
        _shape, custom_error_type="shape", custom_error_message=f"should be {expected}"
    )


Stop = Annotated[
    Annotated[Text, Tag("a text")] | Annotated[StopStrings, Tag("list of texts")],
    by_shape("a string or a list of strings"),
]
Prompt = Annotated[
    Annotated[Text, Tag("a text")]
    | Annotated[TokenIds, Tag("token ids")]
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("list of texts")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("token id lists")],
    by_shape("a string, a list of token ids, or a list of either"),
]


class Strict(BaseModel):
    """Closed, strictly typed, finite numbers (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    """Send one more chunk before ``[DONE]``, with ``"choices": []`` and the usage."""


class SamplingRequest(Strict):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share."""

    model: Str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    """Default 1.0 (OpenAI's); 0 is greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """0 or -1: off."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
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
    user: Str | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt as text, token ids, or a list of either."""

    prompt: Prompt
    echo: bool = False
    """Prefix each choice's text with its prompt's."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: Str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[
        Annotated[Str, Tag("a text")]
        | Annotated[
            list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS), Tag("text parts")
        ],
        by_shape("a string or a list of text parts"),
    ]
    name: Str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Takes precedence over ``max_tokens``; without either, the rest of the context."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeRequest(Strict):
    """``POST /tokenize``: text (``prompt``) or messages, as the completion routes encode them."""

    model: Str
    prompt: Str | None = None
    messages: Messages | None = None


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids to text."""

    model: Str
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]
