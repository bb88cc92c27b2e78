"""Sampling parameters of one request: a frozen, validated value.

Invariants (checked at construction, so a bad value never reaches the hot loop; each refusal is
an ``InvalidRequestError`` naming the field):
- ``1 <= max_tokens`` and ``0 <= min_tokens <= max_tokens``: a request generates at least
  ``min_tokens`` tokens (its stop tokens are masked until then, and stop strings are not
  matched) and at most ``max_tokens``.
- ``temperature == 0`` means greedy (argmax, first index on ties); ``top_k``, ``top_p``,
  ``min_p`` and ``seed`` are then ignored. ``temperature > 0`` samples from
  ``softmax(logits / temperature)`` restricted by ``min_p`` (``0`` = off: keep tokens at least
  ``min_p`` times as likely as the most likely one), then ``top_k`` (``0`` = off) and ``top_p``
  (``1.0`` = off).
- Penalties apply before both, to greedy rows too (as vLLM applies them): ``repetition_penalty``
  (``1`` = off, in ``(0, 2]``) divides the positive logits and multiplies the negative ones of
  every token of the prompt and the output; ``frequency_penalty`` and ``presence_penalty``
  (``0`` = off, in ``[-2, 2]``) subtract ``count`` and ``count > 0`` times themselves from the
  logits of the tokens of the output.
- ``seed`` makes sampling reproducible: the request gets its own generator, so the same seed and
  the same logits give the same tokens whatever else shares the batch. Without a seed, sampling
  draws from torch's global generator.
- Generation stops after a token of ``stop_token_ids``, or of the engine's EOS ids
  (``LLM(eos_token_ids=...)``, the checkpoint's for an engine ``build_engine`` builds) unless
  ``ignore_eos``; that token is part of the output ids (and, being special, of no text). It
  also stops once the output text contains a string of ``stop``; the text then ends before it
  (``include_stop_str_in_output``: after it). Stop strings need an engine with a detokenizer.
- ``logprobs`` (``None`` = off, else ``0 .. 20``): each output token carries its log-probability
  under the model's logits of that step, and the ``logprobs`` most likely tokens with theirs.
- ``n`` choices per prompt (``LLM.generate``): choice ``i`` samples with ``choice(i)``, whose
  seed is ``seed + i``, so the choices differ and each is reproducible alone.
- ``detokenize``: keep the output's text as it grows (``RequestOutput.text``); stop strings
  need it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import attrs

from runners.engine.errors import InvalidRequestError

__all__ = ["MAX_LOGPROBS", "MAX_STOP_STRINGS", "SamplingParams"]

MAX_LOGPROBS = 20
"""The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` bound)."""
MAX_STOP_STRINGS = 16
"""The most stop strings one request may give."""


def _int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {number}")
    return number


def _number(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    inside = (low < value if open_low else low <= value) and value <= high
    if not inside:
        bracket = "(" if open_low else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _max_tokens(value: Any) -> int:
    return _int("max_tokens", value, minimum=1)


def _min_tokens(value: Any) -> int:
    return _int("min_tokens", value, minimum=0)


def _top_k(value: Any) -> int:
    return _int("top_k", value, minimum=0)


def _n(value: Any) -> int:
    return _int("n", value, minimum=1)


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"temperature must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"temperature must be finite and >= 0, got {value!r}")
    return float(value)


def _top_p(value: Any) -> float:
    return _number("top_p", value, 0.0, 1.0, open_low=True)


def _min_p(value: Any) -> float:
    return _number("min_p", value, 0.0, 1.0)


def _repetition(value: Any) -> float:
    return _number("repetition_penalty", value, 0.0, 2.0, open_low=True)


def _presence(value: Any) -> float:
    return _number("presence_penalty", value, -2.0, 2.0)


def _frequency(value: Any) -> float:
    return _number("frequency_penalty", value, -2.0, 2.0)


def _seed(value: Any) -> int | None:
    return None if value is None else _int("seed", value, minimum=0)


def _logprobs(value: Any) -> int | None:
    return None if value is None else _int("logprobs", value, minimum=0, maximum=MAX_LOGPROBS)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {value!r}")
    return value


def _include_stop(value: Any) -> bool:
    return _flag("include_stop_str_in_output", value)


def _ignore_eos(value: Any) -> bool:
    return _flag("ignore_eos", value)


def _detokenize(value: Any) -> bool:
    return _flag("detokenize", value)


def _stop_ids(value: Iterable[Any]) -> frozenset[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"stop_token_ids must be a collection of ints, got {value!r}")
    return frozenset(_int("stop token id", v, minimum=0) for v in value)


def _stop(value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if isinstance(strings, bytes) or not isinstance(strings, Iterable):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {value!r}")
    strings = tuple(strings)
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
    return tuple(dict.fromkeys(strings))


def _at_most_max_tokens(params: SamplingParams, attribute: Any, value: int) -> None:
    if value > params.max_tokens:
        raise InvalidRequestError(
            f"min_tokens must be <= max_tokens, got {value} > {params.max_tokens}"
        )


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples and when it stops (see the module docstring)."""

    max_tokens: int = attrs.field(default=16, converter=_max_tokens)
    min_tokens: int = attrs.field(default=0, converter=_min_tokens, validator=_at_most_max_tokens)
    temperature: float = attrs.field(default=0.0, converter=_temperature)
    top_k: int = attrs.field(default=0, converter=_top_k)
    top_p: float = attrs.field(default=1.0, converter=_top_p)
    min_p: float = attrs.field(default=0.0, converter=_min_p)
    seed: int | None = attrs.field(default=None, converter=_seed)
    n: int = attrs.field(default=1, converter=_n)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    include_stop_str_in_output: bool = attrs.field(default=False, converter=_include_stop)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_ids)
    ignore_eos: bool = attrs.field(default=False, converter=_ignore_eos)
    presence_penalty: float = attrs.field(default=0.0, converter=_presence)
    frequency_penalty: float = attrs.field(default=0.0, converter=_frequency)
    repetition_penalty: float = attrs.field(default=1.0, converter=_repetition)
    logprobs: int | None = attrs.field(default=None, converter=_logprobs)
    detokenize: bool = attrs.field(default=True, converter=_detokenize)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def stop_ids(self, eos_token_ids: Iterable[int] = ()) -> frozenset[int]:
        """Every token id that ends generation: ``stop_token_ids``, and the engine's
        ``eos_token_ids`` unless ``ignore_eos``."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids | frozenset(eos_token_ids)

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one choice, seed ``seed + index``."""
        if not 0 <= index < self.n:
            raise InvalidRequestError(f"choice {index} is outside n = {self.n}")
        seed = None if self.seed is None else self.seed + index
        return attrs.evolve(self, n=1, seed=seed)
