"""Sampling parameters of one request: a frozen, validated value.

Invariants (checked at construction, so a bad value never reaches the hot loop):
- ``max_tokens >= 1``: every request generates at least one token.
- ``temperature == 0`` means greedy (argmax, first index on ties); ``top_k``, ``top_p`` and
  ``seed`` are then ignored. ``temperature > 0`` samples from ``softmax(logits / temperature)``
  restricted by ``top_k`` (``0`` = off) and ``top_p`` (``1.0`` = off).
- ``seed`` makes sampling reproducible: the request gets its own generator, so the same seed and
  the same logits give the same tokens whatever else shares the batch. Without a seed, sampling
  draws from torch's global generator.
- Generation stops after a token in ``stop_token_ids`` (or ``eos_token_id``); that token is part
  of the output, as with Hugging Face ``generate``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import attrs

from runners.engine.errors import InvalidRequestError

__all__ = ["SamplingParams"]


def _int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {number}")
    return number


def _max_tokens(value: Any) -> int:
    return _int("max_tokens", value, minimum=1)


def _top_k(value: Any) -> int:
    return _int("top_k", value, minimum=0)


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"temperature must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"temperature must be finite and >= 0, got {value!r}")
    return float(value)


def _top_p(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"top_p must be a number, got {value!r}")
    if not 0.0 < value <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {value!r}")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    return _int("seed", value, minimum=0)


def _eos(value: Any) -> int | None:
    if value is None:
        return None
    return _int("eos_token_id", value, minimum=0)


def _stop_ids(value: Iterable[Any]) -> frozenset[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"stop_token_ids must be a collection of ints, got {value!r}")
    return frozenset(_int("stop token id", v, minimum=0) for v in value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples and when it stops (see the module docstring)."""

    max_tokens: int = attrs.field(default=16, converter=_max_tokens)
    temperature: float = attrs.field(default=0.0, converter=_temperature)
    top_k: int = attrs.field(default=0, converter=_top_k)
    top_p: float = attrs.field(default=1.0, converter=_top_p)
    seed: int | None = attrs.field(default=None, converter=_seed)
    eos_token_id: int | None = attrs.field(default=None, converter=_eos)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token id that ends generation (``stop_token_ids`` plus ``eos_token_id``)."""
        if self.eos_token_id is None:
            return self.stop_token_ids
        return self.stop_token_ids | {self.eos_token_id}
