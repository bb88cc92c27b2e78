"""A request whose logits cannot be sampled fails alone; a step that raises leaves the engine
usable.

The reference executor poisons chosen requests (NaN logits once their history reaches a length);
every other request must produce exactly the reference loop's tokens, the failed one keeps the
tokens it had, and every block and row is free once nothing is live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import pytest

from runners.engine import (
    LLM,
    FinishReason,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
)
from runners.engine.sampling import NON_FINITE_LOGITS
from tests.engine.reference import ReferenceExecutor, reference_generate
from tests.engine.test_engine import assert_all_free

VOCAB = 16
BAD = [15, 3, 3]
GOOD = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [2]]
GREEDY = SamplingParams(max_tokens=5)
SAMPLED = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=7)
GOOD_PARAMS = [GREEDY, SamplingParams(max_tokens=4, temperature=1.1, seed=3), GREEDY]


def expected(prompt: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
    return reference_generate(prompt, params, VOCAB)[0]


def poison(prompt: Sequence[int], after: int) -> Callable[[list[int]], bool]:
    """NaN logits for ``prompt``'s request once it has generated ``after`` tokens."""
    return lambda history: (
        history[: len(prompt)] == list(prompt) and (len(history) >= len(prompt) + after)
    )


def executor(**sizes: int) -> ReferenceExecutor:
    return ReferenceExecutor(
        **{"max_rows": 3, "max_num_tokens": 6, "block_size": 2, "num_blocks": 32, **sizes}
    )


def run_steps(llm: LLM) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    while llm.has_unfinished():
        for output in llm.step():
            outputs[output.request_id] = output
    return outputs


@pytest.mark.parametrize("after", [0, 2], ids=["first-token", "third-token"])
@pytest.mark.parametrize("bad_params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_with_nan_logits_fails_alone(bad_params: SamplingParams, after: int) -> None:
    """Greedy NaN rows used to decode to token 0 silently; sampled ones made every step raise."""
    ex = executor()
    ex.poisoned = poison(BAD, after)
    llm = LLM(ex)
    good = [llm.add_request(GOOD[0], GOOD_PARAMS[0])]
    bad = llm.add_request(BAD, bad_params)
    good += [llm.add_request(p, sp) for p, sp in zip(GOOD[1:], GOOD_PARAMS[1:], strict=True)]
    outputs = run_steps(llm)
    failed = outputs[bad]
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.error == f"request {bad!r} failed: {NON_FINITE_LOGITS}"
    assert failed.output_ids == (
        expected(BAD, attrs.evolve(bad_params, max_tokens=after)) if after else ()
    )
    for request_id, prompt, params in zip(good, GOOD, GOOD_PARAMS, strict=True):
        assert outputs[request_id].finish_reason is FinishReason.LENGTH
        assert outputs[request_id].error is None
        assert outputs[request_id].output_ids == expected(prompt, params)
    assert_all_free(llm)
    again = llm.generate(GOOD, GOOD_PARAMS)
    assert [o.output_ids for o in again] == [
        expected(p, sp) for p, sp in zip(GOOD, GOOD_PARAMS, strict=True)
    ]


def test_generate_raises_once_the_others_finished_with_every_output() -> None:
    ex = executor(max_num_tokens=4)
    ex.poisoned = poison(BAD, 1)
    llm = LLM(ex)
    with pytest.raises(RequestFailedError) as error:
        llm.generate([GOOD[0], BAD, GOOD[1]], GREEDY)
    assert str(error.value) == (
        f"request '1' failed: {NON_FINITE_LOGITS}; 2 of the call's 3 requests finished normally"
    )
    outputs = error.value.outputs
    assert [o.finish_reason for o in outputs] == [
        FinishReason.LENGTH,
        FinishReason.ERROR,
        FinishReason.LENGTH,
    ]
    assert error.value.failed == [outputs[1]]
    assert outputs[1].output_ids == expected(BAD, attrs.evolve(GREEDY, max_tokens=1))
    assert [outputs[0].output_ids, outputs[2].output_ids] == [
        expected(GOOD[0], GREEDY),
        expected(GOOD[1], GREEDY),
    ]
    assert_all_free(llm)
    (output,) = llm.generate([GOOD[2]], GREEDY)
    assert output.output_ids == expected(GOOD[2], GREEDY)


def test_several_failures_are_counted_and_step_level_requests_are_unaffected() -> None:
    other_bad = [15, 1]
    ex = executor()
    ex.poisoned = lambda history: poison(BAD, 0)(history) or poison(other_bad, 3)(history)
    llm = LLM(ex)
    mine = llm.add_request(GOOD[1], GREEDY)
    with pytest.raises(RequestFailedError, match=r"^request '1' failed: .* \(and 1 more\); 1 of"):
        llm.generate([BAD, GOOD[0], other_bad], SAMPLED)
    (delivered,) = run_steps(llm).values()
    assert delivered.request_id == mine
    assert delivered.output_ids == expected(GOOD[1], GREEDY)
    assert_all_free(llm)


def test_a_temperature_that_overflows_the_logits_fails_only_its_request() -> None:
    llm = LLM(executor())
    tiny = SamplingParams(max_tokens=3, temperature=1e-45, top_p=0.5, seed=1)
    with pytest.raises(RequestFailedError) as error:
        llm.generate(GOOD, [GREEDY, tiny, SAMPLED])
    outputs = error.value.outputs
    assert outputs[1].error == (
        "request '1' failed: its logits divided by temperature 1e-45 overflow float32 "
        "(non-finite probabilities); use a larger temperature"
    )
    assert outputs[1].output_ids == ()
    assert [outputs[0].output_ids, outputs[2].output_ids] == [
        expected(GOOD[0], GREEDY),
        expected(GOOD[2], SAMPLED),
    ]
    assert_all_free(llm)


def test_a_step_that_raises_is_retried_as_it_was_and_failures_still_fail_alone() -> None:
    """A step whose executor raises may have admitted requests and given them blocks; the next
    step feeds exactly the same chunks through the same blocks."""
    ex = executor(max_rows=2, max_num_tokens=4)
    ex.poisoned = poison(BAD, 1)
    llm = LLM(ex)
    ids = [llm.add_request(p, GREEDY) for p in (GOOD[1], BAD, GOOD[0])]
    outputs: dict[str, RequestOutput] = {}
    for step in range(40):
        if step in (0, 3, 5):
            ex.fail_next = RuntimeError("device lost")
            with pytest.raises(RuntimeError, match="device lost"):
                llm.step()
            failed = ex.steps[-1]
            outputs.update({o.request_id: o for o in llm.step()})
            assert ex.steps[-1] == failed
        else:
            outputs.update({o.request_id: o for o in llm.step()})
    assert outputs[ids[1]].finish_reason is FinishReason.ERROR
    assert outputs[ids[0]].output_ids == expected(GOOD[1], GREEDY)
    assert outputs[ids[2]].output_ids == expected(GOOD[0], GREEDY)
    assert_all_free(llm)


def test_a_step_that_preempted_then_raised_keeps_the_preemption_and_retries_the_rest() -> None:
    """A and B outgrow 6 blocks at their fourth step, which preempts B (the newest) and then
    raises: B stays preempted (counted once), A's retry feeds the same position through the same
    blocks, and both outputs are the reference's."""
    ex = executor(num_blocks=6, max_rows=4, max_num_tokens=16)
    llm = LLM(ex)
    prompts, params = [[1, 2], [6, 7, 8, 9]], [GREEDY, SamplingParams(max_tokens=5)]
    a, b = (llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True))
    outputs: dict[str, RequestOutput] = {}
    for _ in range(3):
        outputs.update({o.request_id: o for o in llm.step()})
    ex.fail_next = RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        llm.step()
    failed = ex.steps[-1]
    stats = llm.stats()
    assert (stats.running, stats.waiting, stats.preemptions) == (1, 1, 1)
    assert llm.scheduler.waiting[0].request_id == b
    assert len(llm.generated(b)) == 3
    outputs.update({o.request_id: o for o in llm.step()})
    assert ex.steps[-1] == failed
    outputs.update(run_steps(llm))
    assert llm.stats().preemptions == 1
    assert outputs[a].output_ids == expected(prompts[0], params[0])
    assert outputs[b].output_ids == expected(prompts[1], params[1])
    assert_all_free(llm)
