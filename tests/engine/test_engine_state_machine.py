"""A hypothesis state machine drives a graph-capturing engine and an eager engine in lockstep.

Operations (after one request per row to start with): add a request, step, abort a live
request, clear the captured graphs (the next steps capture again). After every operation both
engines must report the same finished requests with the same tokens, the same queue and cache
occupancy and the same preemptions, and each keeps its block accounting (no block held twice,
held + free = all, a waiting or preempted request holds nothing). The graph engine runs the
default resolution on the CPU (V2, FULL decode, PIECEWISE mixed, narrow region) with small
capture sizes, so steps mix replayed FULL and PIECEWISE graphs, padding and eager fallback. The
cache has 5 blocks for 3 rows of up to 4 blocks each, so requests are preempted and recomputed
(through graphs, too) whenever three grow at once.
"""

from __future__ import annotations

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.weights import randomize_
from runners import CacheLayout, SamplingParams
from runners.engine import LLM, RequestOutput
from runners.spec import Engine, EngineSpec, build_engine
from tests.engine.test_engine_properties import check_block_accounting

CONFIG = DeepseekV4Config(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=16,
    q_lora_rank=16,
    o_groups=1,
    o_lora_rank=8,
    partial_rotary_factor=0.5,
    sliding_window=4,
    layer_types=(
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ),
    compress_rate_csa=2,
    compress_rate_hca=4,
    index_n_heads=8,
    index_head_dim=8,
    index_topk=3,
    hc_mult=2,
    mlp_layer_types=("hash_moe", "moe", "moe"),
    moe_intermediate_size=16,
    n_routed_experts=3,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
SPEC = EngineSpec(
    platform="cpu",
    capture_sizes=(1, 2, 4),
    max_num_tokens=8,
    layout=CacheLayout(num_blocks=5, block_size=4, max_rows=3, max_blocks_per_row=6),
)
BUDGET = 6
PROMPTS = st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=9)
MAX_TOKENS = st.integers(1, 6)


def _engine(**changes: object) -> Engine:
    model = DeepseekV4ForCausalLM(CONFIG)
    randomize_(model, 3, num_experts=CONFIG.n_routed_experts)
    return build_engine(attrs.evolve(SPEC, **changes), model=model)


def _summary(outputs: list[RequestOutput]) -> list[tuple[str, tuple[int, ...], str]]:
    return sorted((o.request_id, o.output_ids, o.finish_reason.value) for o in outputs)


class EngineAgainstEager(RuleBasedStateMachine):
    """The graph engine and the eager engine, fed identical operations."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.graphs = _engine()
        self.eager = _engine(cudagraph_mode="NONE")
        self.graph_llm = LLM(self.graphs.runner, max_num_batched_tokens=BUDGET)
        self.eager_llm = LLM(self.eager.runner, max_num_batched_tokens=BUDGET)
        self.next_id = 0
        self.tokens_compared = 0

    @initialize(
        target=live,
        requests=st.lists(st.tuples(PROMPTS, MAX_TOKENS), min_size=3, max_size=3),
    )
    def one_request_per_row(self, requests: list[tuple[list[int], int]]) -> MultipleResults[str]:
        """Start with every row taken, so the cache is contended from the first steps."""
        return multiple(*(self.add_request(prompt, n) for prompt, n in requests))

    @rule(target=live, prompt=PROMPTS, max_tokens=MAX_TOKENS)
    def add_request(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens)
        self.graph_llm.add_request(prompt, params, request_id=request_id)
        self.eager_llm.add_request(prompt, params, request_id=request_id)
        return request_id

    @precondition(lambda self: self.eager_llm.has_unfinished())
    @rule()
    def step(self) -> None:
        graph_out = _summary(self.graph_llm.step())
        eager_out = _summary(self.eager_llm.step())
        assert graph_out == eager_out
        self.tokens_compared += sum(len(tokens) for _, tokens, _ in graph_out)

    @rule(request_id=consumes(live))
    def abort(self, request_id: str) -> None:
        graph_out = self.graph_llm.abort(request_id)
        eager_out = self.eager_llm.abort(request_id)
        assert (graph_out is None) == (eager_out is None)
        if graph_out is not None and eager_out is not None:
            assert _summary([graph_out]) == _summary([eager_out])

    @rule()
    def clear_graphs_and_recapture(self) -> None:
        self.graphs.runner.clear_graphs()
        assert self.graphs.runner.captured == ()

    @invariant()
    def same_occupancy(self) -> None:
        assert self.graph_llm.stats() == self.eager_llm.stats()

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        check_block_accounting(self.graph_llm)
        check_block_accounting(self.eager_llm)

    def teardown(self) -> None:
        while self.eager_llm.has_unfinished():
            assert _summary(self.graph_llm.step()) == _summary(self.eager_llm.step())
        assert not self.graph_llm.has_unfinished()
        stats = self.graph_llm.stats()
        assert stats.free_blocks == stats.total_blocks and stats.free_rows == stats.total_rows
        event("preempted" if stats.preemptions else "not preempted")


EngineAgainstEager.TestCase.settings = settings(
    settings(),
    max_examples=max(2, settings().max_examples // 6),
    stateful_step_count=25,
)
test_engine_matches_eager_under_random_operations = EngineAgainstEager.TestCase


def test_the_machine_preempts_and_recomputes() -> None:
    """Three requests growing at once outgrow the 5 blocks: the machine's cache really preempts,
    and both engines still agree token for token (the rules above, applied by hand)."""
    machine = EngineAgainstEager()
    for prompt in ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]):
        machine.add_request(prompt, max_tokens=6)
    while machine.eager_llm.has_unfinished():
        machine.step()
        machine.same_occupancy()
        machine.blocks_are_accounted_for()
    assert machine.eager_llm.stats().preemptions > 0
    assert machine.tokens_compared == 18
    stats = machine.graph_llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_rows == stats.total_rows
