"""Checking a request before the engine takes it: every refusal is an ``InvalidRequestError``
(``RequestTooLongError`` for one that can never fit) with a one-line message, raised before
anything changes.

A request is refused when its prompt is not a non-empty sequence of token ids in the vocabulary,
its parameters are not ``SamplingParams`` or name a stop token outside the vocabulary or stop
strings the engine cannot see (no detokenizer, or ``detokenize`` off), or when its prompt plus
``max_tokens`` can never fit one row (the maximum context) or the blocks of either pool at the
most it holds at once (``Scheduler.most_held``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from runners.engine.errors import InvalidRequestError, RequestTooLongError
from runners.engine.params import SamplingParams
from runners.engine.scheduler import Scheduler

__all__ = ["check_fits", "check_params", "check_prompt"]


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """The prompt as a tuple of token ids in ``[0, vocab_size)``."""
    if isinstance(prompt_ids, str | bytes):
        raise InvalidRequestError("prompt must be a sequence of token ids, not text")
    try:
        prompt = tuple(operator.index(t) for t in prompt_ids)
    except TypeError:
        raise InvalidRequestError(
            f"prompt must be a sequence of int token ids, got {prompt_ids!r:.60}"
        ) from None
    if not prompt:
        raise InvalidRequestError("prompt is empty: give at least one token id")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        position, bad = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"token id {bad} at position {position} is outside the vocabulary [0, {vocab_size})"
        )
    return prompt


def check_params(
    params: SamplingParams | None, vocab_size: int, has_detokenizer: bool
) -> SamplingParams:
    """``params`` (the defaults for None), refused if the engine cannot honour them."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
    if params.stop and not (has_detokenizer and params.detokenize):
        raise InvalidRequestError(
            "stop strings need text: "
            + ("detokenize is off" if has_detokenizer else "this engine has no detokenizer")
        )
    for stop in sorted(params.stop_token_ids):
        if stop >= vocab_size:
            raise InvalidRequestError(
                f"stop token id {stop} is outside the vocabulary [0, {vocab_size})"
            )
    return params


def check_fits(
    prompt: tuple[int, ...], params: SamplingParams, scheduler: Scheduler, max_context: int
) -> None:
    """Refuse a request that can never fit a row or the cache (module docstring)."""
    cached = len(prompt) + params.max_tokens - 1
    if len(prompt) > max_context:
        raise RequestTooLongError(
            f"prompt of {len(prompt)} tokens exceeds the maximum context of {max_context} tokens"
        )
    if cached > max_context:
        raise RequestTooLongError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the "
            f"maximum context of {max_context} tokens; use max_tokens <= "
            f"{max_context - len(prompt) + 1}"
        )
    blocks, entry_blocks = scheduler.most_held(cached)
    pools = scheduler.blocks, scheduler.entry_blocks
    for needed, pool, what in zip((blocks, entry_blocks), pools, ("KV", "entry"), strict=True):
        if needed > pool.size:
            raise RequestTooLongError(
                f"request needs {needed} {what} blocks of {scheduler.block_size} tokens but the "
                f"cache has {pool.size}; shorten the prompt or max_tokens"
            )
