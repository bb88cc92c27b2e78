"""Hypothesis: random caches, budgets, arrivals, aborts, executor failures and requests whose
logits turn to NaN; the engine's tokens equal the reference loop's (a failed request's up to its
failure), every step keeps the scheduling and block-accounting invariants, and everything is free
at the end."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from runners.engine import (
    LLM,
    FinishReason,
    RequestOutput,
    RequestTooLongError,
    SamplingParams,
)
from tests.engine.reference import ReferenceExecutor, reference_generate

VOCAB = 12
MAX_STEPS = 500
POISON = VOCAB - 1
"""First prompt token of the requests whose logits turn to NaN (no other prompt starts with it)."""


@attrs.frozen(kw_only=True)
class Arrival:
    prompt: tuple[int, ...]
    params: SamplingParams
    at_step: int
    abort_at: int | None
    poisoned: bool


@attrs.frozen(kw_only=True)
class Scenario:
    executor: dict[str, int]
    budget: int
    arrivals: tuple[Arrival, ...]
    failing_steps: frozenset[int]
    poison_length: int
    """A poisoned request's logits are NaN once its history is this long."""


tokens = st.integers(0, VOCAB - 1)
greedy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 6),
    eos_token_id=st.none() | tokens,
)
seeded = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 6),
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(0, VOCAB + 2),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**32),
    stop_token_ids=st.frozensets(tokens, max_size=2),
)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    sizes = {
        "block_size": draw(st.integers(1, 5)),
        "max_blocks_per_row": draw(st.integers(1, 6)),
        "num_blocks": draw(st.integers(1, 14)),
        "max_rows": draw(st.integers(1, 4)),
        "max_num_tokens": draw(st.integers(1, 12)),
        "vocab_size": VOCAB,
    }
    context = sizes["block_size"] * sizes["max_blocks_per_row"]
    arrival = st.builds(
        Arrival,
        prompt=st.lists(tokens, min_size=1, max_size=context + 2).map(tuple),
        params=greedy | seeded,
        at_step=st.integers(0, 8),
        abort_at=st.none() | st.integers(0, 20),
        poisoned=st.booleans(),
    ).map(
        lambda a: attrs.evolve(
            a, prompt=(POISON if a.poisoned else a.prompt[0] % POISON, *a.prompt[1:])
        )
    )
    return Scenario(
        executor=sizes,
        budget=draw(st.integers(1, sizes["max_num_tokens"])),
        arrivals=tuple(draw(st.lists(arrival, min_size=1, max_size=6))),
        failing_steps=draw(st.frozensets(st.integers(0, 20), max_size=2)),
        poison_length=draw(st.integers(1, context + 4)),
    )


def fits(arrival: Arrival, sizes: dict[str, int]) -> bool:
    """The admission rule restated: the KV of all tokens but the last fits a row and the cache."""
    cached = len(arrival.prompt) + arrival.params.max_tokens - 1
    blocks = -(-cached // sizes["block_size"])
    return blocks <= sizes["max_blocks_per_row"] and blocks <= sizes["num_blocks"]


def check_step_invariants(llm: LLM, executor: ReferenceExecutor, budget: int, before: dict) -> None:
    """Decodes precede prefills, the budget holds, an unspent budget left no request out, and the
    live requests' blocks are disjoint and, with the free ones, make up the whole cache."""
    chunks = executor.steps[-1]
    assert sum(c.num_tokens for c in chunks) <= budget
    decode = [c.row in before and c.start_position >= before[c.row] for c in chunks]
    assert decode == sorted(decode, reverse=True)
    if sum(c.num_tokens for c in chunks) < budget:
        assert set(before) <= {c.row for c in chunks}
    scheduler = llm.scheduler
    held = [b for r in scheduler.running for b in r.block_ids]
    assert len(set(held)) == len(held)
    assert len(held) + scheduler.blocks.num_free == scheduler.blocks.size
    committed = sum(r.max_blocks for r in scheduler.running)
    assert scheduler.committed_blocks == committed <= scheduler.blocks.size


@settings(max_examples=8 * settings().max_examples)
@given(scenarios())
def test_engine_equals_reference_under_any_schedule(scenario: Scenario) -> None:
    executor = ReferenceExecutor(**scenario.executor)
    executor.poisoned = lambda h: h[0] == POISON and len(h) >= scenario.poison_length
    llm = LLM(executor, max_num_batched_tokens=scenario.budget)
    ids: dict[str, Arrival] = {}
    results: dict[str, RequestOutput] = {}
    step = 0
    while step <= 8 or llm.has_unfinished():
        assert step < MAX_STEPS, "the engine stopped making progress"
        for arrival in scenario.arrivals:
            if arrival.at_step == step:
                if fits(arrival, scenario.executor):
                    ids[llm.add_request(arrival.prompt, arrival.params)] = arrival
                else:
                    try:
                        llm.add_request(arrival.prompt, arrival.params)
                    except RequestTooLongError:
                        continue
                    raise AssertionError("a request that can never fit was accepted")
        for request_id, arrival in ids.items():
            if arrival.abort_at == step and request_id not in results:
                aborted = llm.abort(request_id)
                assert aborted is not None
                results[request_id] = aborted
        before = {r.row: r.prompt_len for r in llm.scheduler.running}
        calls = len(executor.steps)
        if step in scenario.failing_steps and llm.has_unfinished():
            executor.fail_next = RuntimeError("injected")
            try:
                llm.step()
            except RuntimeError:
                pass
            else:
                executor.fail_next = None
        else:
            for output in llm.step():
                assert output.request_id not in results
                results[output.request_id] = output
        if len(executor.steps) > calls:
            check_step_invariants(llm, executor, scenario.budget, before)
        step += 1
    assert set(results) == set(ids)
    for request_id, arrival in ids.items():
        output = results[request_id]
        want, reason = reference_generate(arrival.prompt, arrival.params, VOCAB)
        assert output.prompt_ids == arrival.prompt
        healthy = max(scenario.poison_length - len(arrival.prompt), 0)
        if arrival.poisoned and len(want) > healthy:
            want, reason = want[:healthy], FinishReason.ERROR
        assert (output.error is not None) == (output.finish_reason is FinishReason.ERROR)
        if output.finish_reason is FinishReason.ABORT:
            assert output.output_ids == want[: len(output.output_ids)]
        else:
            assert (output.output_ids, output.finish_reason) == (want, reason)
    stats = llm.stats()
    assert (stats.free_blocks, stats.free_rows) == (stats.total_blocks, stats.total_rows)
