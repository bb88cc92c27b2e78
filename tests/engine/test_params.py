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
        ({"stop_token_ids": 3}, "stop_token_ids must be a collection"),
        ({"stop_token_ids": [1, "x"]}, "stop token id must be an integer"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 17}, "min_tokens must be <= max_tokens, got 17 > 16"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, "n must be >= 1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 2\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": "x"}, "frequency_penalty must be a number"),
        ({"logprobs": 21}, "logprobs must be <= 20"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": 3}, "stop must be a string or a list of strings"),
        ({"stop": ["a"] * 17}, "stop takes at most 16 strings"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(changes: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**changes)
    with pytest.raises(InvalidRequestError, match=message):
        attrs.evolve(SamplingParams(), **changes)


def test_values_are_normalised_and_stop_ids_include_eos_unless_ignored() -> None:
    params = SamplingParams(max_tokens=3, temperature=1, top_p=1, stop_token_ids=[4, 4, 2])
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert isinstance(params.temperature, float)
    assert params.stop_ids() == frozenset({2, 4})
    assert params.stop_ids([9]) == frozenset({2, 4, 9})
    assert attrs.evolve(params, ignore_eos=True).stop_ids([9]) == frozenset({2, 4})
    assert SamplingParams().greedy and not params.greedy
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["b", "a", "b"]).stop == ("b", "a")


def test_choices_take_consecutive_seeds() -> None:
    params = SamplingParams(n=3, seed=10, temperature=1.0)
    assert [p.seed for p in map(params.choice, range(3))] == [10, 11, 12]
    assert {p.n for p in map(params.choice, range(3))} == {1}
    assert SamplingParams(n=2).choice(1).seed is None
    with pytest.raises(InvalidRequestError, match="choice 3 is outside n = 3"):
        params.choice(3)
