"""The engine against a direct reference generation loop, on fixed scenarios.

Every test compares tokens with ``reference_generate`` (one request alone, logits recomputed from
the full history) and checks that every block and row is free once nothing is live.
"""

from __future__ import annotations

import attrs
import pytest

from runners.engine import (
    LLM,
    EngineConfigError,
    ExecutorError,
    FinishReason,
    GenerateProgress,
    InvalidRequestError,
    RequestTooLongError,
    SamplingParams,
)
from tests.engine.reference import ReferenceExecutor, reference_generate

VOCAB = 16


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert (stats.waiting, stats.running) == (0, 0)
    assert stats.free_blocks == stats.total_blocks
    assert stats.free_rows == stats.total_rows
    assert not llm.has_unfinished()


def expected(prompt: list[int], params: SamplingParams) -> tuple[tuple[int, ...], FinishReason]:
    return reference_generate(prompt, params, VOCAB)


def test_generate_matches_reference_with_chunked_prefill() -> None:
    executor = ReferenceExecutor(max_rows=3, max_num_tokens=5, num_blocks=24, block_size=2)
    llm = LLM(executor)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [0, 15], [5, 4, 3]]
    params = SamplingParams(max_tokens=5)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_ids == tuple(prompt)
        assert (output.output_ids, output.finish_reason) == expected(prompt, params)
    assert max(sum(c.num_tokens for c in step) for step in executor.steps) == 5
    assert_all_free(llm)


def test_long_prefill_is_split_across_steps_and_decodes_go_first() -> None:
    executor = ReferenceExecutor(max_num_tokens=3, block_size=4)
    llm = LLM(executor)
    first = llm.add_request([1, 2], SamplingParams(max_tokens=6))
    llm.step()
    second = llm.add_request(list(range(10)), SamplingParams(max_tokens=2))
    finished = {}
    while llm.has_unfinished():
        finished.update({o.request_id: o for o in llm.step()})
    shapes = [[(c.row, c.start_position, c.num_tokens) for c in step] for step in executor.steps]
    assert shapes[:5] == [
        [(0, 0, 2)],
        [(0, 2, 1), (1, 0, 2)],
        [(0, 3, 1), (1, 2, 2)],
        [(0, 4, 1), (1, 4, 2)],
        [(0, 5, 1), (1, 6, 2)],
    ]
    assert finished[first].output_ids == expected([1, 2], SamplingParams(max_tokens=6))[0]
    assert finished[second].output_ids == expected(list(range(10)), SamplingParams(max_tokens=2))[0]
    assert_all_free(llm)


def test_requests_are_admitted_by_their_first_chunk_and_the_newest_is_preempted() -> None:
    """A (4 blocks at worst) and B (4 at worst) do not fit 6 blocks together, yet both start at
    once; when B's next token needs a block and none is free, B (the newest) is preempted, waits
    for A to finish, and is recomputed from its 7 tokens (prompt and output so far) in one chunk."""
    executor = ReferenceExecutor(num_blocks=6, block_size=2, max_rows=4)
    llm = LLM(executor)
    a_params, b_params = SamplingParams(max_tokens=6), SamplingParams(max_tokens=5)
    a = llm.add_request([1, 2], a_params)
    b = llm.add_request([6, 7, 8, 9], b_params)
    outputs = {}
    stats = []
    while llm.has_unfinished():
        outputs.update({o.request_id: o for o in llm.step()})
        stats.append(llm.stats())
    shapes = [[(c.row, c.start_position, c.num_tokens) for c in step] for step in executor.steps]
    assert shapes == [
        [(0, 0, 2), (1, 0, 4)],
        [(0, 2, 1), (1, 4, 1)],
        [(0, 3, 1), (1, 5, 1)],
        [(0, 4, 1)],
        [(0, 5, 1)],
        [(0, 6, 1)],
        [(0, 0, 7)],
        [(0, 7, 1)],
    ]
    assert [(s.running, s.waiting, s.preemptions) for s in stats[:4]] == [
        (2, 0, 0),
        (2, 0, 0),
        (2, 0, 0),
        (1, 1, 1),
    ]
    assert stats[-1].preemptions == 1
    assert outputs[a].output_ids == expected([1, 2], a_params)[0]
    assert outputs[b].output_ids == expected([6, 7, 8, 9], b_params)[0]
    assert_all_free(llm)


def test_eos_stops_and_is_part_of_the_output() -> None:
    prompt = [4, 2]
    free_run, _ = expected(prompt, SamplingParams(max_tokens=6))
    eos = free_run[2]
    params = SamplingParams(max_tokens=6, stop_token_ids=[eos])
    (output,) = LLM(ReferenceExecutor()).generate([prompt], params)
    assert output.finish_reason is FinishReason.STOP
    assert output.output_ids == free_run[: free_run.index(eos) + 1]


def test_abort_waiting_and_running_requests() -> None:
    executor = ReferenceExecutor(max_rows=1)
    llm = LLM(executor)
    params = SamplingParams(max_tokens=8)
    running = llm.add_request([1, 2, 3], params)
    waiting = llm.add_request([4, 5], params)
    kept = llm.add_request([6], params)
    llm.step()
    llm.step()
    aborted_running = llm.abort(running)
    aborted_waiting = llm.abort(waiting)
    assert aborted_running is not None and aborted_waiting is not None
    assert aborted_running.finish_reason is FinishReason.ABORT
    assert aborted_running.output_ids == expected([1, 2, 3], params)[0][:2]
    assert aborted_waiting.output_ids == ()
    assert llm.abort(running) is None
    assert llm.abort("no such request") is None
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert [(o.request_id, o.output_ids) for o in outputs] == [(kept, expected([6], params)[0])]
    assert_all_free(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ([], None, InvalidRequestError, "prompt is empty"),
        ("hello", None, InvalidRequestError, "not text"),
        ([1, 2.5], None, InvalidRequestError, "int token ids"),
        ([1, VOCAB], None, InvalidRequestError, f"token id {VOCAB} at position 1"),
        ([-1], None, InvalidRequestError, "token id -1 at position 0"),
        ([1], SamplingParams(stop_token_ids=[VOCAB]), InvalidRequestError, "stop token id"),
        ([1], {"max_tokens": 3}, InvalidRequestError, "params must be SamplingParams"),
        (list(range(9)), None, RequestTooLongError, "prompt of 9 tokens exceeds"),
        ([1] * 5, SamplingParams(max_tokens=5), RequestTooLongError, "max_tokens <= 4"),
    ],
)
def test_bad_requests_are_refused_without_side_effects(
    prompt: object, params: object, error: type[Exception], message: str
) -> None:
    executor = ReferenceExecutor(block_size=2, max_blocks_per_row=4, num_blocks=8)
    llm = LLM(executor)
    live = llm.add_request([3, 1], SamplingParams(max_tokens=3))
    llm.step()
    before = llm.stats()
    with pytest.raises(error, match=message):
        llm.add_request(prompt, params)  # type: ignore[arg-type]
    assert llm.stats() == before
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert [o.output_ids for o in outputs] == [expected([3, 1], SamplingParams(max_tokens=3))[0]]
    assert outputs[0].request_id == live
    assert_all_free(llm)


def test_requests_that_exactly_fill_a_row_run() -> None:
    llm = LLM(ReferenceExecutor(block_size=2, max_blocks_per_row=4, num_blocks=8))
    prompts = [[1] * 8, [2] * 5]
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=4)]
    outputs = llm.generate(prompts, params)
    want = [expected(p, sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.output_ids for o in outputs] == want
    assert_all_free(llm)


def test_request_larger_than_the_whole_cache_is_refused() -> None:
    llm = LLM(ReferenceExecutor(block_size=2, max_blocks_per_row=8, num_blocks=3))
    with pytest.raises(RequestTooLongError, match=r"needs 4 KV blocks .* has 3"):
        llm.add_request([1] * 6, SamplingParams(max_tokens=3))
    (output,) = llm.generate([[1] * 6], SamplingParams(max_tokens=1))
    assert output.output_ids == expected([1] * 6, SamplingParams(max_tokens=1))[0]


def test_duplicate_live_id_is_refused_and_generate_is_atomic() -> None:
    llm = LLM(ReferenceExecutor())
    llm.add_request([1], request_id="x")
    with pytest.raises(InvalidRequestError, match="'x' is already live"):
        llm.add_request([2], request_id="x")
    with pytest.raises(InvalidRequestError, match="token id 99"):
        llm.generate([[1, 2], [99]])
    assert llm.stats().waiting == 1
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize(
    ("budget", "sizes", "message"),
    [
        (
            0,
            {},
            r"max_num_batched_tokens must be in \[1, 16\] \(the executor's max_num_tokens\), got 0",
        ),
        (17, {}, r"max_num_batched_tokens must be in \[1, 16\]"),
        (None, {"num_blocks": 0}, r"^EngineLimits.num_blocks must be an int >= 1, got 0$"),
        (None, {"vocab_size": 0}, r"^EngineLimits.vocab_size must be an int >= 1, got 0$"),
        (None, {"block_size": True}, r"^EngineLimits.block_size must be an int >= 1, got True$"),
    ],
)
def test_bad_engine_settings_are_refused(
    budget: int | None, sizes: dict[str, int], message: str
) -> None:
    with pytest.raises(EngineConfigError, match=message):
        LLM(ReferenceExecutor(max_num_tokens=16, **sizes), max_num_batched_tokens=budget)


def test_executor_failure_mid_step_leaves_the_engine_usable() -> None:
    executor = ReferenceExecutor(max_num_tokens=4, block_size=2)
    llm = LLM(executor)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    params = SamplingParams(max_tokens=5)
    ids = [llm.add_request(p, params) for p in prompts]
    outputs = {}
    for step in range(12):
        if step in (1, 4):
            executor.fail_next = RuntimeError("device lost")
            with pytest.raises(RuntimeError, match="device lost"):
                llm.step()
        outputs.update({o.request_id: o for o in llm.step()})
    assert [outputs[i].output_ids for i in ids] == [expected(p, params)[0] for p in prompts]
    assert_all_free(llm)


def test_malformed_logits_raise_executor_error() -> None:
    class Narrow(ReferenceExecutor):
        def execute(self, chunks, token_ids):  # type: ignore[no-untyped-def]
            return super().execute(chunks, token_ids)[:, :-1]

    llm = LLM(Narrow())
    llm.add_request([1, 2])
    with pytest.raises(ExecutorError, match=r"shape \(1, 15\).*expected float32 \(1, 16\)"):
        llm.step()
    assert llm.abort("0") is not None
    assert_all_free(llm)


def test_generate_reports_progress_and_aborts_its_requests_on_interrupt() -> None:
    llm = LLM(ReferenceExecutor(max_rows=2))
    reports: list[GenerateProgress] = []
    outputs = llm.generate(
        [[1], [2, 3], [4]], SamplingParams(max_tokens=3), progress=reports.append
    )
    assert [r.finished for r in reports] == sorted(r.finished for r in reports)
    assert reports[-1] == GenerateProgress(finished=3, total=3, generated_tokens=9)
    assert [len(o.output_ids) for o in outputs] == [3, 3, 3]

    def interrupt(report: GenerateProgress) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1], [2, 3], [4]], progress=interrupt)
    assert_all_free(llm)


def test_step_level_requests_finishing_during_generate_are_delivered_by_step() -> None:
    llm = LLM(ReferenceExecutor())
    mine = llm.add_request([5, 5], SamplingParams(max_tokens=1))
    (output,) = llm.generate([[6, 6, 6]], SamplingParams(max_tokens=4))
    assert output.output_ids == expected([6, 6, 6], SamplingParams(max_tokens=4))[0]
    assert llm.has_unfinished()
    (delivered,) = llm.step()
    assert delivered.request_id == mine
    assert delivered.output_ids == expected([5, 5], SamplingParams(max_tokens=1))[0]
    assert_all_free(llm)


def test_seeded_sampling_reproduces_whatever_shares_the_batch() -> None:
    params = SamplingParams(max_tokens=6, temperature=1.3, top_k=9, top_p=0.9, seed=1234)
    prompt = [3, 1, 4]
    alone = LLM(ReferenceExecutor()).generate([prompt], params)[0].output_ids
    crowd = [[2, 7], prompt, [1, 1, 1, 1, 1]]
    mixed = [SamplingParams(max_tokens=4), params, SamplingParams(temperature=0.7, seed=5)]
    together = LLM(ReferenceExecutor(max_num_tokens=3)).generate(crowd, mixed)[1].output_ids
    assert alone == together == expected(prompt, params)[0]
    other_seeds = {
        LLM(ReferenceExecutor()).generate([prompt], attrs.evolve(params, seed=s))[0].output_ids
        for s in range(8)
    }
    assert len(other_seeds) > 1
