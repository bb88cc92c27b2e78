"""The request parameters clients send, in the engine, against references computed one token at a
time: penalties and min_tokens (a per-token Python loop over the vocabulary), log-probabilities
(``log_softmax`` of the reference logits), stop strings (the whole text), n choices (separate
requests), EOS ids (the engine's, unless ignored) and listeners (their updates add up to the
output). Requests run batched, in a cache small enough to preempt, so the batched processing
and its per-row counts are checked under continuous batching."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runners import EngineSpec, build_engine
from runners.engine import LLM, FinishReason, InvalidRequestError, RequestUpdate, SamplingParams
from runners.text import ByteLevelTokenizer
from tests.engine.reference import ReferenceExecutor, history_logits

VOCAB = 16
TEXT_VOCAB = 128
"""Byte-level ids of ASCII characters, for the requests with text."""
decode = ByteLevelTokenizer().decode


def small_engine(vocab: int = VOCAB, **options: object) -> LLM:
    executor = ReferenceExecutor(
        max_rows=3, num_blocks=10, block_size=2, max_blocks_per_row=12, vocab_size=vocab
    )
    return LLM(executor, max_num_batched_tokens=6, **options)  # type: ignore[arg-type]


def processed(
    raw: torch.Tensor, history: Sequence[int], prompt_len: int, p: SamplingParams
) -> list[float]:
    """The documented penalties and min_tokens mask, token by token in float64."""
    output = history[prompt_len:]
    counts = Counter(output)
    seen = set(history)
    values = []
    for token, value in enumerate(raw.double().tolist()):
        if token in seen:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        value -= p.frequency_penalty * counts[token] + p.presence_penalty * (counts[token] > 0)
        if len(output) < p.min_tokens and token in p.stop_token_ids:
            value = -math.inf
        values.append(value)
    return values


def reference(prompt: Sequence[int], p: SamplingParams, vocab: int = VOCAB) -> tuple[int, ...]:
    history = list(prompt)
    while len(history) - len(prompt) < p.max_tokens:
        values = processed(history_logits(history, vocab), history, len(prompt), p)
        token = values.index(max(values))
        history.append(token)
        if token in p.stop_token_ids and len(history) - len(prompt) > p.min_tokens:
            break
    return tuple(history[len(prompt) :])


penalties = st.sampled_from([0.0, 0.5, -1.0, 2.0])
greedy_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 8),
    presence_penalty=penalties,
    frequency_penalty=penalties,
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    stop_token_ids=st.frozensets(st.integers(0, VOCAB - 1), max_size=3),
    min_tokens=st.integers(0, 1),
)
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9)


@given(st.lists(st.tuples(prompts, greedy_params), min_size=1, max_size=5))
def test_penalties_and_min_tokens_equal_the_token_by_token_reference(
    requests: list[tuple[list[int], SamplingParams]],
) -> None:
    llm = small_engine()
    outputs = llm.generate([r[0] for r in requests], [r[1] for r in requests])
    assert [o.output_ids for o in outputs] == [reference(*r) for r in requests]
    assert llm.stats().free_rows == 3


def test_min_tokens_masks_every_stop_id_until_then() -> None:
    prompt = [3, 1, 4]
    free = reference(prompt, SamplingParams(max_tokens=6))
    stops = frozenset(free)  # every token it would pick
    held = small_engine().generate(
        [prompt], SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=stops)
    )
    assert len(held[0].output_ids) >= 5 and not set(held[0].output_ids[:4]) & stops


@given(st.lists(prompts, min_size=1, max_size=4), st.integers(0, 5))
def test_logprobs_are_those_of_the_step_logits(batch: list[list[int]], top: int) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=top)
    for prompt, output in zip(batch, small_engine().generate(batch, params), strict=True):
        assert output.logprobs is not None and len(output.logprobs) == len(output.output_ids)
        history = list(prompt)
        for token, entry in zip(output.output_ids, output.logprobs, strict=True):
            want = history_logits(history, VOCAB).log_softmax(dim=-1)
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(want[token]), abs=1e-6)
            values, ids = want.topk(top)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
            history.append(token)


@given(st.lists(st.integers(32, 126), min_size=1, max_size=6), st.data())
def test_stop_strings_end_the_request_where_its_whole_text_has_one(
    prompt: list[int], data: st.DataObject
) -> None:
    free = reference(prompt, SamplingParams(max_tokens=12), TEXT_VOCAB)
    text = decode(free)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 3))]
    llm = small_engine(TEXT_VOCAB, detokenize=decode)
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=12, stop=[stop]))
    at = text.find(stop)
    assert output.text == text[:at]
    assert output.output_ids == free[: at + len(stop)]  # ASCII: one token per character
    assert output.finish_reason is FinishReason.STOP


def test_stop_strings_need_a_detokenizer() -> None:
    with pytest.raises(InvalidRequestError, match="stop strings need text"):
        small_engine().generate([[1]], SamplingParams(stop=["x"]))


def test_n_choices_are_the_requests_of_consecutive_seeds() -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3)
    together = small_engine().generate([[1, 2], [3]], params)
    assert len(together) == 6
    alone = [
        small_engine().generate([prompt], params.choice(i))[0].output_ids
        for prompt in ([1, 2], [3])
        for i in range(3)
    ]
    assert [o.output_ids for o in together] == alone
    with pytest.raises(InvalidRequestError, match="add_request takes one choice"):
        small_engine().add_request([1], params)


def test_the_engine_eos_ids_stop_requests_unless_ignored() -> None:
    prompt = [4, 2]
    free = reference(prompt, SamplingParams(max_tokens=8))
    eos = free[2]
    (stopped,) = small_engine(eos_token_ids=[eos]).generate([prompt], SamplingParams(max_tokens=8))
    assert stopped.output_ids == free[: free.index(eos) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    ignored = small_engine(eos_token_ids=[eos]).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert ignored[0].output_ids == free


def test_build_engine_stops_at_the_checkpoints_eos_and_decodes_its_text() -> None:
    llm = build_engine(EngineSpec(platform="cpu", cudagraph_mode="NONE")).llm
    assert llm.eos_token_ids == {257}  # the built-in model's config
    assert llm.detokenize is not None and llm.detokenize([72, 105, 257]) == "Hi"


def test_updates_add_up_to_the_output() -> None:
    llm = small_engine(TEXT_VOCAB, detokenize=decode)
    updates: dict[str, list[RequestUpdate]] = {}
    params = [
        SamplingParams(max_tokens=9, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.7, seed=1, stop=["e"]),
        SamplingParams(max_tokens=7),
    ]
    ids = [
        llm.add_request(
            [65 + i, 66], p, listener=lambda u: updates.setdefault(u.request_id, []).append(u)
        )
        for i, p in enumerate(params)
    ]
    finished = {}
    while llm.has_unfinished():
        for output in llm.step():
            finished[output.request_id] = output
    for request_id in ids:
        got = updates[request_id]
        output = finished[request_id]
        assert [u.finished for u in got] == [None] * (len(got) - 1) + [output]
        assert sum((u.token_ids for u in got), ()) == output.output_ids
        assert "".join(u.text for u in got) == output.text
        assert sum((u.logprobs for u in got), ()) == (output.logprobs or ())
