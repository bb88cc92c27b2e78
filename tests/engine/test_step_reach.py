"""``StepReach.of_requests`` bounds every step the engine schedules for known requests, so
``dsv4 run`` may capture only the graphs inside it: drawn prompts, new-token counts, step
budgets and pools small enough to preempt (about a quarter of the drawn runs preempt; a
preempted request is recomputed in one chunk)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runners.batch import StepReach
from runners.engine import LLM, SamplingParams
from tests.engine.reference import ReferenceExecutor


@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    max_tokens=st.integers(1, 8),
    num_blocks=st.integers(10, 24),
    budget=st.integers(4, 16),
    data=st.data(),
)
def test_every_step_of_the_requests_stays_within_their_reach(
    lengths: list[int], max_tokens: int, num_blocks: int, budget: int, data: st.DataObject
) -> None:
    executor = ReferenceExecutor(num_blocks=num_blocks, block_size=2, max_blocks_per_row=12)
    llm = LLM(executor, max_num_batched_tokens=budget)
    prompts = [data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n)) for n in lengths]
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    reach = StepReach.of_requests(lengths, max_tokens)
    assert executor.steps
    for step in executor.steps:
        tokens = sum(chunk.num_tokens for chunk in step)
        if all(chunk.num_tokens == 1 for chunk in step):
            assert tokens <= reach.decode_batch
        assert tokens <= reach.step_tokens
        assert max(c.start_position + c.num_tokens for c in step) <= reach.positions
    # the bound is tight: the furthest step of the longest request reaches it exactly
    furthest = max(c.start_position + c.num_tokens for step in executor.steps for c in step)
    assert furthest == reach.positions


def test_the_reach_of_two_prompts() -> None:
    # 7 + 5 - 1 = 11 and 2 + 5 - 1 = 6 positions: two decode together, 17 tokens at most
    reach = StepReach(decode_batch=2, step_tokens=17, positions=11)
    assert StepReach.of_requests([7, 2], 5) == reach
