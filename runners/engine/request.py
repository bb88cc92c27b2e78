"""A request's life in the engine, and the value it hands back when it finishes.

A request's token sequence is ``prompt + output``. ``num_computed`` counts the leading tokens whose
KV is in the cache; the rest are fed in the next chunks. The invariants the scheduler keeps:
- ``0 <= num_computed < len(token_ids)`` while the request is live: the newest token is always
  still to be fed (the last token of a finished request never is).
- ``(released + len(block_ids)) * block_size >= num_computed``: the request's blocks cover every
  cached token; they are an ordered list (block ``released + i`` holds positions
  ``(released+i)*B ..``). The first ``released`` blocks held positions every later query is past
  the lookback of: they went back to the pool while the request runs (``kv_blocks``). Blocks
  before where a prefix-cache hit ended may be shared with other requests (read-only); every
  block the request still writes is its own.
- ``entry_block_ids`` (ordered, never released while the request runs, shared only where
  complete) cover its compressed entries: one entry slot per ``entry_rate`` cached tokens.
- ``row`` is a block-table row held by this request alone from admission to finish, abort or
  preemption. A waiting request (new or preempted) holds no row and no block.
- Preemption empties the cache of a request (``num_computed = 0``, no blocks of either pool, no
  row; on resumption it may start from its own blocks, if the prefix cache still has them) and
  keeps everything else: ``token_ids`` (so the tokens generated so far are neither lost nor
  generated again, and still count toward ``max_tokens``) and ``generator`` (whose state has
  advanced only for tokens actually sampled).
- ``text`` (when the request detokenizes) and ``logprobs`` (when it asks for them) follow
  ``token_ids``: they cover exactly the output tokens sampled so far, preemption included.
- Updates (``RequestUpdate``, for a request added with a listener) hand out each output token,
  each piece of stable text and each token's log-probabilities exactly once, in order; the last
  update of a request carries its ``RequestOutput``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs
import torch

from runners.engine.errors import EngineError
from runners.engine.params import SamplingParams
from runners.engine.text import Detokenize, IncrementalText

__all__ = [
    "FinishReason",
    "Listener",
    "Request",
    "RequestFailedError",
    "RequestOutput",
    "RequestUpdate",
    "TokenLogprob",
]


class FinishReason(enum.Enum):
    """Why a request stopped."""

    LENGTH = "length"
    """It generated ``max_tokens`` tokens."""
    STOP = "stop"
    """It generated a stop (or EOS) token, which ends its output."""
    ABORT = "abort"
    """``LLM.abort`` removed it; its output holds the tokens generated so far."""
    ERROR = "error"
    """Its next token could not be sampled (``RequestOutput.error`` says why); its output holds
    the tokens generated before. Only this request stopped: the others of its step went on."""


@attrs.frozen(kw_only=True)
class TokenLogprob:
    """One output token's log-probability under the model's logits of its step (before
    penalties and temperature), and the most likely tokens of that step with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """``(token id, log-probability)`` of the ``SamplingParams.logprobs`` most likely tokens,
    most likely first."""


@attrs.frozen(kw_only=True)
class RequestOutput:
    """What a finished (or aborted) request produced."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: FinishReason
    error: str | None = None
    """For ``FinishReason.ERROR`` (and only then): one line naming the request and the reason."""
    text: str | None = None
    """The output's text (cut before a matched stop string), when the engine has a detokenizer
    and the request detokenizes; else None."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One entry per output token when the request asked for log-probabilities; else None."""


@attrs.frozen(kw_only=True)
class RequestUpdate:
    """What one step added to a request: handed to its listener (``LLM.add_request``)."""

    request_id: str
    token_ids: tuple[int, ...]
    """Output tokens new since the last update."""
    text: str
    """Stable text new since the last update (``IncrementalText.stable``); "" without text."""
    logprobs: tuple[TokenLogprob, ...]
    """The new tokens' log-probabilities (empty when not asked for)."""
    finished: RequestOutput | None
    """The request's output, on its last update (it finished, stopped or failed in this step)."""


Listener = Callable[[RequestUpdate], None]
"""Called by ``LLM.step`` (in the stepping thread, under the engine's lock) with each update."""


class Request:
    """Mutable engine-side state of one live request (see the module docstring)."""

    __slots__ = (
        "block_hashes",
        "block_ids",
        "block_tuple",
        "entry_block_ids",
        "entry_block_tuple",
        "generator",
        "listener",
        "logprobs",
        "max_len",
        "num_computed",
        "params",
        "prompt_len",
        "recorded_to",
        "released",
        "request_id",
        "row",
        "sent",
        "stop_ids",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenize: Detokenize | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.stop_ids = params.stop_ids(eos_token_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_len = self.prompt_len + params.max_tokens
        """Length of the token sequence at which the request stops (``FinishReason.LENGTH``)."""
        self.num_computed = 0
        self.row: int | None = None
        self.block_ids: list[int] = []
        self.released = 0
        """Leading blocks given back to the pool (their positions left every lookback)."""
        self.block_tuple: tuple[int, ...] = ()
        """The block list a chunk carries (``RELEASED_BLOCK`` for each released one), rebuilt
        only when it changes."""
        self.entry_block_ids: list[int] = []
        self.entry_block_tuple: tuple[int, ...] = ()
        self.block_hashes: list[bytes] = []
        """Prefix-cache keys of the leading full blocks of ``token_ids`` (``prefix_cache``),
        extended as they are needed; they depend on the tokens alone, so preemption keeps them."""
        self.recorded_to = 0
        """Positions whose complete blocks the prefix cache has keyed (or found) so far."""
        self.generator: torch.Generator | None = None
        self.text: IncrementalText | None = None
        if detokenize is not None and params.detokenize:
            self.text = IncrementalText(detokenize, params.stop, params.include_stop_str_in_output)
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.listener = listener
        self.sent = (0, 0, 0)
        """Output tokens, characters of text and logprobs handed to the listener so far."""

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def take_token(self, token: int) -> bool:
        """Append a sampled token; return True if a stop string now ends the output."""
        self.token_ids.append(token)
        if self.text is None:
            return False
        past_min = self.num_output > self.params.min_tokens
        return self.text.push(self.token_ids, self.prompt_len, past_min)

    def output(self, reason: FinishReason, error: str | None = None) -> RequestOutput:
        text = None
        if self.text is not None:
            self.text.flush(self.token_ids, self.prompt_len)
            text = self.text.text
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=tuple(self.token_ids[: self.prompt_len]),
            output_ids=tuple(self.token_ids[self.prompt_len :]),
            finish_reason=reason,
            error=error,
            text=text,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
        )

    def update(self, finished: RequestOutput | None) -> RequestUpdate:
        """What is new since the last update (module docstring), and marks it handed out."""
        tokens, chars, logprobs = self.sent
        stable = len(self.text.text) if finished is not None and self.text else None
        if stable is None:
            stable = self.text.stable if self.text is not None else 0
        new_text = self.text.text[chars:stable] if self.text is not None else ""
        new_logprobs = tuple(self.logprobs[logprobs:]) if self.logprobs is not None else ()
        self.sent = (self.num_output, max(chars, stable), logprobs + len(new_logprobs))
        return RequestUpdate(
            request_id=self.request_id,
            token_ids=tuple(self.token_ids[self.prompt_len + tokens :]),
            text=new_text,
            logprobs=new_logprobs,
            finished=finished,
        )


class RequestFailedError(EngineError, RuntimeError):
    """Requests of one ``LLM.generate`` call failed: their next token could not be sampled (the
    model gave NaN or inf logits, say). Raised once every request of the call has finished, so
    the others ran to completion: ``outputs`` holds all of them in prompt order, the failed ones
    with ``FinishReason.ERROR`` and their ``error``; ``failed`` holds only those."""

    def __init__(self, outputs: Sequence[RequestOutput]) -> None:
        self.outputs = list(outputs)
        self.failed = [o for o in self.outputs if o.error is not None]
        more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        finished = len(self.outputs) - len(self.failed)
        super().__init__(
            f"{self.failed[0].error}{more}; {finished} of the call's {len(self.outputs)} "
            "requests finished normally"
        )
