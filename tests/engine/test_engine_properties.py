"""Hypothesis: random caches, budgets, arrivals sharing random prefixes, aborts, executor failures
and requests whose logits turn to NaN, with or without a prefix cache; the engine's tokens equal
the reference loop's (a failed request's up to its failure), every step keeps the scheduling,
preemption and block-accounting invariants, and everything is free at the end. Caches are
small, so many schedules preempt, and requests that share a prefix start from each other's
blocks (the reference executor reads every token of a history back through them)."""

from __future__ import annotations

import collections

import attrs
from hypothesis import event, given, settings
from hypothesis import strategies as st

from runners.engine import (
    LLM,
    FinishReason,
    RequestOutput,
    RequestTooLongError,
    SamplingParams,
)
from runners.engine.request import Request
from runners.engine.scheduler import RELEASED_BLOCK
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
    prefix_boundary: int | None
    """Where prefix-cache hits may end (None: no prefix cache)."""
    budget: int
    arrivals: tuple[Arrival, ...]
    failing_steps: frozenset[int]
    poison_length: int
    """A poisoned request's logits are NaN once its history is this long."""


tokens = st.integers(0, VOCAB - 1)
greedy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 6),
    stop_token_ids=st.frozensets(tokens, max_size=1),
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
    boundary_blocks = draw(st.none() | st.integers(1, 3))
    context = sizes["block_size"] * sizes["max_blocks_per_row"]
    shared = draw(
        st.lists(tokens, min_size=min(context, 3 * sizes["block_size"]), max_size=context)
    )
    arrival = st.builds(
        Arrival,
        prompt=st.builds(
            lambda n, own: (*shared[:n], *own),
            st.just(len(shared)) | st.integers(0, len(shared)),
            st.lists(tokens, min_size=1, max_size=context + 2),
        ),
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
        prefix_boundary=None if boundary_blocks is None else boundary_blocks * sizes["block_size"],
        budget=draw(st.integers(1, sizes["max_num_tokens"])),
        arrivals=tuple(draw(st.lists(arrival, min_size=1, max_size=6))),
        failing_steps=draw(st.frozensets(st.integers(0, 20), max_size=2)),
        poison_length=draw(st.integers(1, context + 4)),
    )


def fits(arrival: Arrival, sizes: dict[str, int]) -> bool:
    """The refusal rule restated: the KV of all tokens but the last fits a row and the cache."""
    cached = len(arrival.prompt) + arrival.params.max_tokens - 1
    blocks = -(-cached // sizes["block_size"])
    return blocks <= sizes["max_blocks_per_row"] and blocks <= sizes["num_blocks"]


@attrs.frozen(kw_only=True)
class Before:
    """The running requests before a step, oldest first."""

    ids: tuple[str, ...]
    rows: tuple[int, ...]
    decoding: frozenset[int]
    """Rows of the requests past their prefill (one token pending, none of their prompt)."""
    preemptions: int

    @classmethod
    def of(cls, llm: LLM) -> Before:
        running = llm.scheduler.running
        return cls(
            ids=tuple(r.request_id for r in running),
            rows=tuple(r.row for r in running if r.row is not None),
            decoding=frozenset(
                r.row
                for r in running
                if r.row is not None
                and r.num_computed >= r.prompt_len
                and len(r.token_ids) - r.num_computed == 1
            ),
            preemptions=llm.stats().preemptions,
        )


def check_block_accounting(llm: LLM) -> None:
    """Running requests hold blocks, entry blocks and rows which, with the free ones, make up
    the pools; a block's references are the running requests holding it. Requests share a block
    only with a prefix cache, each at the same place in its list, with equal tokens up to where
    it is complete and having computed past that (so none writes it again); a released block held
    only positions past the lookback of every later query; every other live request (new or
    preempted) waits holding nothing."""
    scheduler = llm.scheduler
    size = scheduler.block_size
    cache = scheduler.prefix_cache

    def entry_block_end(index: int) -> int:
        """Where entry block ``index`` is complete: the boundary its last entry is done by."""
        assert cache is not None
        end = (index + 1) * size * scheduler.entry_rate
        return -(-end // cache.boundary) * cache.boundary

    for pool, holdings, end_of in (
        (
            scheduler.blocks,
            [(r, r.released, r.block_ids) for r in scheduler.running],
            lambda index: (index + 1) * size,
        ),
        (
            scheduler.entry_blocks,
            [(r, 0, r.entry_block_ids) for r in scheduler.running],
            entry_block_end,
        ),
    ):
        holders: dict[int, list[tuple[Request, int]]] = collections.defaultdict(list)
        for request, first, ids in holdings:
            for index, block in enumerate(ids, start=first):
                holders[block].append((request, index))
        for block, held_by in holders.items():
            assert pool.refs(block) == len(held_by)
            if len(held_by) == 1:
                continue
            assert cache is not None, f"block {block} shared without a prefix cache"
            assert len({index for _, index in held_by}) == 1, f"block {block} shared apart"
            end = end_of(held_by[0][1])
            assert len({tuple(r.token_ids[:end]) for r, _ in held_by}) == 1
            assert all(r.num_computed >= end for r, _ in held_by)
        assert len(holders) + pool.num_free == pool.size
    rows = [r.row for r in scheduler.running]
    assert None not in rows and len(set(rows)) == len(rows)
    assert len(rows) + scheduler.rows.num_free == scheduler.rows.size
    size, lookback = scheduler.block_size, scheduler.lookback
    for request in scheduler.running:
        assert (request.released + len(request.block_ids)) * size >= request.num_computed
        if lookback is None:
            assert request.released == 0
        else:  # the next query reads positions from num_computed - lookback + 1 on
            assert request.released * size <= max(0, request.num_computed - lookback + 1)
        released = (RELEASED_BLOCK,) * request.released
        assert request.block_tuple == released + tuple(request.block_ids)
        entries = request.num_computed // scheduler.entry_rate
        assert len(request.entry_block_ids) * size >= entries
        assert request.entry_block_tuple == tuple(request.entry_block_ids)
    for request in scheduler.waiting:
        assert (request.row, request.block_ids, request.num_computed) == (None, [], 0)
        assert (request.released, request.entry_block_ids) == (0, [])
    live = [r.request_id for r in (*scheduler.running, *scheduler.waiting)]
    assert sorted(live) == sorted(scheduler.live)


def check_step_invariants(
    llm: LLM, executor: ReferenceExecutor, budget: int, before: Before
) -> None:
    """Decodes precede prefills and the budget holds; the requests preempted are the newest
    running ones, never the oldest, they wait at the front of the queue in admission order, and
    nothing is admitted in their step; an unspent budget left out no running request that was not
    preempted; block accounting holds."""
    chunks = executor.steps[-1]
    assert sum(c.num_tokens for c in chunks) <= budget
    decode = [c.row in before.decoding for c in chunks]
    assert decode == sorted(decode, reverse=True)
    waiting = [r.request_id for r in llm.scheduler.waiting]
    preempted = [i for i in before.ids if i in waiting]
    kept = len(before.ids) - len(preempted)
    assert before.ids[kept:] == tuple(preempted) == tuple(waiting[: len(preempted)])
    assert llm.stats().preemptions - before.preemptions == len(preempted)
    if preempted:
        assert kept >= 1, "the oldest running request was preempted"
        assert {c.row for c in chunks} <= set(before.rows[:kept]), "admitted after a preemption"
    if sum(c.num_tokens for c in chunks) < budget:
        assert set(before.rows[:kept]) <= {c.row for c in chunks}
    check_block_accounting(llm)


@settings(max_examples=8 * settings().max_examples)
@given(scenarios())
def test_engine_equals_reference_under_any_schedule(scenario: Scenario) -> None:
    executor = ReferenceExecutor(**scenario.executor, prefix_boundary=scenario.prefix_boundary)
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
        before = Before.of(llm)
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
    event("preempted" if stats.preemptions else "not preempted")
    if stats.prefix_cache is not None:
        event("prefix hit" if stats.prefix_cache.hits else "no prefix hit")
