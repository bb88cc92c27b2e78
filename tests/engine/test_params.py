"""SamplingParams: validation with one clear error per bad field, and the stop-token set."""

from __future__ import annotations

import attrs
import pytest

from runners.engine import InvalidRequestError, SamplingParams


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be finite and >= 0"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"eos_token_id": -1}, "eos_token_id must be >= 0"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a collection"),
        ({"stop_token_ids": [1, "x"]}, "stop token id must be an integer"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(changes: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**changes)
    with pytest.raises(InvalidRequestError, match=message):
        attrs.evolve(SamplingParams(), **changes)


def test_values_are_normalised_and_stop_ids_include_eos() -> None:
    params = SamplingParams(max_tokens=3, temperature=1, top_p=1, stop_token_ids=[4, 4, 2])
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert isinstance(params.temperature, float)
    assert params.stop_ids == frozenset({2, 4})
    assert attrs.evolve(params, eos_token_id=9).stop_ids == frozenset({2, 4, 9})
    assert SamplingParams().greedy and not params.greedy
