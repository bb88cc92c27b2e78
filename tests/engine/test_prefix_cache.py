"""The prefix cache against the reference executor, which reads every token of a history back
through the blocks it is handed: a hit on the wrong blocks (another prefix's, or blocks written
since) changes the logits, and with them the tokens compared with ``reference_generate``.

Fixed scenarios pin down what is found (the longest boundary that leaves a token to compute,
never a prefix whose earlier blocks differ), what is kept (cached blocks nobody holds count as
free and are evicted least recently used first) and how it composes with preemption (a
preempted request finds its own blocks). A hypothesis test then runs random prompts built from
shared prefixes (whole blocks, partial blocks, identical prompts, one a prefix of another, a
prompt with its first token changed) through small pools.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from runners.engine import LLM, RequestOutput, SamplingParams
from runners.engine.prefix_cache import PrefixCacheStats
from tests.engine.reference import ReferenceExecutor, reference_generate
from tests.engine.test_engine import assert_all_free
from tests.engine.test_engine_properties import check_block_accounting

VOCAB = 12
GREEDY = SamplingParams(max_tokens=3)


def _executor(**sizes: int) -> ReferenceExecutor:
    defaults = {"block_size": 2, "num_blocks": 32, "max_blocks_per_row": 12, "max_num_tokens": 8}
    return ReferenceExecutor(vocab_size=VOCAB, prefix_boundary=4, **{**defaults, **sizes})


def _stats(llm: LLM) -> PrefixCacheStats:
    stats = llm.stats().prefix_cache
    assert stats is not None
    return stats


def _run(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    (output,) = llm.generate([prompt], params)
    assert output.output_ids == reference_generate(prompt, params, VOCAB)[0]
    return output


def test_a_repeated_prompt_starts_at_its_last_boundary_before_its_last_token() -> None:
    executor = _executor()
    llm = LLM(executor)
    for length, hit in ((11, 8), (8, 4)):  # a hit leaves at least the last prompt token
        prompt = [(3 * i + length) % VOCAB for i in range(length)]
        _run(llm, prompt)
        before = _stats(llm).hit_tokens
        _run(llm, prompt)
        assert _stats(llm).hit_tokens - before == hit
        assert executor.steps[-GREEDY.max_tokens][0].start_position == hit
    assert (_stats(llm).queries, _stats(llm).hits) == (4, 2)
    assert_all_free(llm)


def test_a_prompt_that_is_a_prefix_of_another_and_one_that_extends_it() -> None:
    llm = LLM(_executor())
    long = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1]
    _run(llm, long)
    _run(llm, long[:6])  # finds blocks of the longer prompt: 4 of its 6 tokens
    _run(llm, [*long, 5, 5, 5])  # and the longer one, of the first: 12 tokens
    assert _stats(llm).hit_tokens == 4 + 12


def test_equal_blocks_after_different_ones_are_not_a_hit() -> None:
    """Keys chain every earlier block: a prompt whose first block differs shares nothing, even
    though every later block holds the same tokens."""
    llm = LLM(_executor())
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _run(llm, prompt)
    _run(llm, [0, *prompt[1:]])
    assert _stats(llm).hits == 0


def test_cached_blocks_count_as_free_and_go_least_recently_used_first() -> None:
    executor = _executor(num_blocks=8, max_blocks_per_row=8)
    llm = LLM(executor)
    first, second = [1] * 9, [2] * 9
    _run(llm, first)  # 11 tokens computed: 5 full blocks, and 4 entry blocks (2 boundaries)
    assert llm.stats().free_blocks == 8 and _stats(llm).cached_blocks == 5 + 4
    _run(llm, second)  # 6 of each it needs: 3 blocks and 2 entry blocks evicted, later first
    assert _stats(llm).evicted_blocks == 3 + 2
    before = _stats(llm).hit_tokens
    _run(llm, first)  # its first 4 tokens are still cached (blocks 0 and 1)
    assert _stats(llm).hit_tokens - before == 4
    assert_all_free(llm)


def test_a_preempted_request_finds_its_own_blocks_again() -> None:
    """The second request is preempted after its first token; its blocks are freed last, so
    the first request's growth evicts only its tail, and it resumes from its 8 prompt tokens."""
    executor = _executor(num_blocks=10, max_blocks_per_row=10, max_num_tokens=8, max_rows=2)
    llm = LLM(executor)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2]]
    params = SamplingParams(max_tokens=4)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.output_ids == reference_generate(prompt, params, VOCAB)[0]
    assert llm.stats().preemptions == 1
    stats = _stats(llm)  # the prompts share nothing: only the preempted request can hit
    assert (stats.queries, stats.query_tokens, stats.hits, stats.hit_tokens) == (3, 8 + 8 + 9, 1, 8)
    assert_all_free(llm)


def test_off_it_finds_nothing() -> None:
    llm = LLM(_executor(), enable_prefix_caching=False)
    _run(llm, [1, 2, 3, 4, 5])
    _run(llm, [1, 2, 3, 4, 5])
    assert llm.stats().prefix_cache is None
    assert llm.scheduler.blocks.num_cached == 0


@st.composite
def prompts(draw: st.DrawFn) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt) pairs built from two shared prefixes and earlier prompts."""
    tokens = st.integers(0, VOCAB - 1)
    bases = [draw(st.lists(tokens, min_size=4, max_size=14)) for _ in range(2)]
    made: list[list[int]] = []
    for _ in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from(["shared", "same", "prefix", "first token changed"]))
        if kind == "shared" or not made:
            base = draw(st.sampled_from(bases))
            cut = draw(st.integers(0, len(base)))
            prompt = base[:cut] + draw(st.lists(tokens, min_size=1, max_size=6))
        else:
            earlier = draw(st.sampled_from(made))
            if kind == "same":
                prompt = list(earlier)
            elif kind == "prefix":
                prompt = earlier[: draw(st.integers(1, len(earlier)))]
            else:
                prompt = [(earlier[0] + 1) % VOCAB, *earlier[1:]]
        made.append(prompt)
    return [(draw(st.integers(0, 12)), prompt) for prompt in made]


@settings(max_examples=4 * settings().max_examples)
@given(
    arrivals=prompts(),
    boundary_blocks=st.integers(1, 3),
    block_size=st.integers(1, 3),
    num_blocks=st.integers(10, 24),
    budget=st.integers(1, 8),
    max_tokens=st.integers(1, 4),
)
def test_prefix_cache_equals_reference(
    arrivals: list[tuple[int, list[int]]],
    boundary_blocks: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    max_tokens: int,
) -> None:
    executor = ReferenceExecutor(
        max_rows=3,
        max_num_tokens=8,
        num_blocks=num_blocks,
        block_size=block_size,
        max_blocks_per_row=10,
        vocab_size=VOCAB,
        prefix_boundary=boundary_blocks * block_size,
    )
    llm = LLM(executor, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=max_tokens)
    expected: dict[str, tuple[int, ...]] = {}
    got: dict[str, tuple[int, ...]] = {}
    step = 0
    while step <= 12 or llm.has_unfinished():
        for at, prompt in arrivals:
            if at == step and len(prompt) + max_tokens - 1 <= min(10, num_blocks) * block_size:
                expected[llm.add_request(prompt, params)] = reference_generate(
                    prompt, params, VOCAB
                )[0]
        got.update({o.request_id: o.output_ids for o in llm.step()})
        check_block_accounting(llm)
        step += 1
    assert got == expected
    assert_all_free(llm)
    stats = _stats(llm)
    event("hit" if stats.hits else "no hit")
    event("evicted" if stats.evicted_blocks else "nothing evicted")
    event("preempted" if llm.stats().preemptions else "not preempted")
