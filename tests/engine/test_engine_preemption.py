"""Admission by what is needed now, and preemption by recompute when the KV blocks run out.

The same requests run on an ample pool (no request ever waits for a block) and on a small one; the
tokens, greedy or seeded, must be the same, and equal the reference loop's. Every request arrives
at once and every first chunk fits the small pool, so the small run can only depart from the
ample one by preempting: it must preempt exactly when the ample run held more blocks at once than
the small pool has.
"""

from __future__ import annotations

import attrs
from hypothesis import event, given, settings
from hypothesis import strategies as st

from runners.engine import LLM, RequestOutput, SamplingParams
from tests.engine.reference import ReferenceExecutor, reference_generate
from tests.engine.test_engine import assert_all_free

VOCAB = 12


@attrs.frozen(kw_only=True)
class Case:
    block_size: int
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]

    def max_blocks(self, index: int) -> int:
        """Blocks request ``index`` holds at worst (every token but the last one cached)."""
        cached = len(self.prompts[index]) + self.params[index].max_tokens - 1
        return -(-cached // self.block_size)

    def executor(self, num_blocks: int) -> ReferenceExecutor:
        """Room for every request at once and every prompt in one step; ``num_blocks`` blocks."""
        return ReferenceExecutor(
            max_rows=len(self.prompts),
            max_num_tokens=sum(len(p) for p in self.prompts),
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_blocks_per_row=max(self.max_blocks(i) for i in range(len(self.prompts))),
            vocab_size=VOCAB,
        )


tokens = st.integers(0, VOCAB - 1)
greedy = st.builds(
    SamplingParams, max_tokens=st.integers(1, 12), stop_token_ids=st.frozensets(tokens, max_size=1)
)
seeded = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 12),
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(0, VOCAB),
    top_p=st.floats(0.1, 1.0),
    seed=st.integers(0, 2**32),
    stop_token_ids=st.frozensets(tokens, max_size=1),
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    count = draw(st.integers(2, 5))
    return Case(
        block_size=draw(st.integers(1, 4)),
        prompts=tuple(
            draw(st.lists(tokens, min_size=1, max_size=8).map(tuple)) for _ in range(count)
        ),
        params=tuple(draw(greedy | seeded) for _ in range(count)),
    )


def run(case: Case, num_blocks: int) -> tuple[list[RequestOutput], ReferenceExecutor, LLM]:
    executor = case.executor(num_blocks)
    llm = LLM(executor)
    outputs = llm.generate(case.prompts, case.params)
    assert_all_free(llm)
    return outputs, executor, llm


@settings(max_examples=4 * settings().max_examples)
@given(cases(), st.data())
def test_a_small_pool_preempts_exactly_when_needed_and_changes_no_token(
    case: Case, data: st.DataObject
) -> None:
    count = len(case.prompts)
    ample_outputs, ample_executor, ample = run(case, sum(case.max_blocks(i) for i in range(count)))
    assert ample.stats().preemptions == 0
    peak = max(sum(len(c.block_ids) for c in step) for step in ample_executor.steps)
    first_chunks = sum(-(-len(p) // case.block_size) for p in case.prompts)
    smallest = max(first_chunks, *(case.max_blocks(i) for i in range(count)))
    num_blocks = data.draw(st.integers(smallest, max(smallest, peak)), label="num_blocks")
    outputs, _, small = run(case, num_blocks)
    want = [
        reference_generate(p, sp, VOCAB)[0] for p, sp in zip(case.prompts, case.params, strict=True)
    ]
    assert [o.output_ids for o in ample_outputs] == want
    assert [o.output_ids for o in outputs] == want
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in ample_outputs]
    assert (small.stats().preemptions > 0) == (peak > num_blocks)
    event("preempted" if peak > num_blocks else "not preempted")


def test_more_requests_run_at_once_than_a_worst_case_reservation_allows() -> None:
    """8 blocks of 4 tokens; each request needs 4 blocks at worst but 1 for its prompt. Reserving
    the worst case ran 2 at once; admission by need runs all 4 (then preempts as they grow)."""
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 0]]
    params = SamplingParams(max_tokens=14)
    executor = ReferenceExecutor(max_rows=4, num_blocks=8, block_size=4, vocab_size=VOCAB)
    llm = LLM(executor)
    for prompt in prompts:
        llm.add_request(prompt, params)
    outputs: dict[str, RequestOutput] = {}
    running = []
    while llm.has_unfinished():
        outputs.update({o.request_id: o for o in llm.step()})
        running.append(llm.stats().running)
    reservation = 8 // 4
    assert [len(step) for step in executor.steps[:3]] == [4, 4, 4]
    assert max(running) == 4 > reservation
    assert llm.stats().preemptions > 0
    want = [reference_generate(p, params, VOCAB)[0] for p in prompts]
    assert [outputs[str(i)].output_ids for i in range(4)] == want
    assert_all_free(llm)


def test_a_preempted_seeded_request_resumes_its_draws_where_they_were() -> None:
    """The newer, seeded request is preempted after sampling tokens; recomputing them samples
    nothing, so its generator continues where it stopped and the output is the reference's."""
    old = ([1, 2, 3, 4], SamplingParams(max_tokens=8))
    new = ([5, 6], SamplingParams(max_tokens=8, temperature=1.5, seed=99))
    executor = ReferenceExecutor(max_rows=2, num_blocks=6, block_size=2, vocab_size=VOCAB)
    llm = LLM(executor)
    ids = [llm.add_request(p, sp) for p, sp in (old, new)]
    outputs: dict[str, RequestOutput] = {}
    generated_when_preempted = []
    while llm.has_unfinished():
        preemptions = llm.stats().preemptions
        outputs.update({o.request_id: o for o in llm.step()})
        if llm.stats().preemptions > preemptions:
            (waiting,) = llm.scheduler.waiting
            assert waiting.request_id == ids[1]
            generated_when_preempted.append(len(llm.generated(ids[1])))
    assert generated_when_preempted and generated_when_preempted[0] > 0
    for request_id, (prompt, params) in zip(ids, (old, new), strict=True):
        assert outputs[request_id].output_ids == reference_generate(prompt, params, VOCAB)[0]
    assert_all_free(llm)


def test_one_request_that_fills_the_whole_pool_runs_alone_and_is_never_preempted() -> None:
    """The oldest running request is never preempted: a request as large as the pool runs, the
    one queued behind it waits or is preempted, and both finish."""
    big = ([1] * 5, SamplingParams(max_tokens=4))
    small = ([2, 3], SamplingParams(max_tokens=3))
    executor = ReferenceExecutor(max_rows=2, num_blocks=4, block_size=2, vocab_size=VOCAB)
    llm = LLM(executor)
    ids = [llm.add_request(p, sp) for p, sp in (big, small)]
    outputs: dict[str, RequestOutput] = {}
    while llm.has_unfinished():
        outputs.update({o.request_id: o for o in llm.step()})
        assert all(r.request_id != ids[0] for r in llm.scheduler.waiting)
    assert llm.stats().preemptions > 0
    for request_id, (prompt, params) in zip(ids, (big, small), strict=True):
        assert outputs[request_id].output_ids == reference_generate(prompt, params, VOCAB)[0]
    assert_all_free(llm)
