"""A hypothesis state machine drives a caching engine and a non-caching one in lockstep over a
real model: every request's tokens are equal and its logits within the CPU's tolerance.

Both engines get the same operations: add a request, step, abort a live request. Prompts share
random prefixes: cut from two shared texts at any length (whole blocks, partial blocks, across
compression boundaries), identical to an earlier prompt, a prefix of one, one extended, or one
with its first token changed (equal blocks after a different one). The cache is small (12
blocks of each pool for 3 rows of up to 16 blocks), so requests are preempted, resume from
their own cached blocks, and cached blocks are evicted. Before each step, ``NanFilled`` fills
every meaningless cache row of both engines with NaN (free blocks, evicted ones, rows not
written yet), so reading a released, evicted or never-written block fails that request.

The model makes every part of a continuation's state matter: a one-token sliding window, CSA
at rate 2 (whose overlapping windows read the two positions before a boundary), HCA at rate 8
(whose entries need a whole 8-token window; boundaries fall every 8 tokens, an entry block
covers 4). The caching engine replays graphs (V2, FULL decode, PIECEWISE mixed, narrow region),
the other runs eagerly. Each engine's runner is built once; every example starts new engines on
them (what earlier examples left in the caches is never read: it is NaN or overwritten).
"""

from __future__ import annotations

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from dsv4 import DeepseekV4Config
from dsv4.config import CSA, HCA, SLIDING
from dsv4.testing import random_model
from runners import CacheLayout, ModelRunner, SamplingParams
from runners.engine import LLM, EngineStats, RequestOutput
from runners.measure.equivalence import equality_tolerance
from runners.spec import EngineSpec, build_engine
from tests.engine.nan_filled import NanFilled
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
    sliding_window=1,
    layer_types=(SLIDING, CSA, HCA),
    compress_rate_csa=2,
    compress_rate_hca=8,
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
LAYOUT = CacheLayout(num_blocks=12, block_size=2, max_rows=3, max_blocks_per_row=16)
BUDGET = 6
TOLERANCE = equality_tolerance("cpu", torch.float32)
TOKENS = st.integers(0, CONFIG.vocab_size - 1)
MAX_TOKENS = st.integers(1, 6)
LONGEST = 24
"""Longest prompt: with 6 new tokens it fits a row (32 positions) and, at most held at once,
the pools (8 of 12 blocks, 7 of 12 entry blocks): every request is taken."""


def _runner(mode: str) -> ModelRunner:
    spec = EngineSpec(
        platform="cpu",
        cudagraph_mode=mode,
        capture_sizes=(1, 2, 4),
        max_num_tokens=8,
        layout=LAYOUT,
    )
    return build_engine(spec, model=MODEL).runner


MODEL = random_model(CONFIG, 3)
RUNNERS = {"caching": _runner("FULL_AND_PIECEWISE"), "plain": _runner("NONE")}
"""Built once (captures are reused across examples); every example starts on fresh engines."""


def engine(name: str) -> tuple[LLM, NanFilled]:
    """A fresh engine over runner ``name``, caching prefixes if it is the caching one."""
    executor = NanFilled(RUNNERS[name])
    llm = LLM(executor, max_num_batched_tokens=BUDGET, enable_prefix_caching=name == "caching")
    executor.llm = llm
    return llm, executor


@st.composite
def prompts(draw: st.DrawFn, texts: list[list[int]], earlier: list[list[int]]) -> list[int]:
    """A prompt that shares a prefix with the shared texts or with an earlier prompt."""
    kinds = ["text"] + (["same", "prefix", "extended", "first token changed"] if earlier else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "text":
        text = draw(st.sampled_from(texts))
        cut = draw(st.sampled_from([9, 16, 17, LONGEST]) | st.integers(0, LONGEST))
        prompt = text[:cut] + draw(st.lists(TOKENS, max_size=4))
        return prompt[:LONGEST] or text[:1]
    before = draw(st.sampled_from(earlier))
    if kind == "same":
        return list(before)
    if kind == "prefix":
        return before[: draw(st.integers(1, len(before)))]
    if kind == "extended":
        return (before + draw(st.lists(TOKENS, min_size=1, max_size=8)))[:LONGEST]
    return [(before[0] + 1) % CONFIG.vocab_size, *before[1:]]


def same_request(
    caching: RequestOutput,
    plain: RequestOutput,
    caching_logits: dict[tuple[str, int], torch.Tensor],
    plain_logits: dict[tuple[str, int], torch.Tensor],
) -> None:
    """Equal tokens (up to the shorter, where an abort cut one engine's request short) and
    logits within the tolerance, for every token both sampled; no request failed."""
    assert "error" not in (caching.finish_reason.value, plain.finish_reason.value), (
        caching.error or plain.error
    )
    request = caching.request_id
    differ = f"{request}: {caching.output_ids} with the cache, {plain.output_ids} without"
    shorter = min(len(caching.output_ids), len(plain.output_ids))
    assert caching.output_ids[:shorter] == plain.output_ids[:shorter], differ
    if "abort" not in (caching.finish_reason.value, plain.finish_reason.value):
        assert caching.output_ids == plain.output_ids, differ
        assert caching.finish_reason == plain.finish_reason, differ
    for index in range(shorter):
        difference = (caching_logits[request, index] - plain_logits[request, index]).abs().max()
        assert difference <= TOLERANCE, f"{request} token {index}: logits differ by {difference}"


class CachingAgainstPlain(RuleBasedStateMachine):
    """The caching engine and the plain one, fed identical operations."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.caching, self.caching_executor = engine("caching")
        self.plain, self.plain_executor = engine("plain")
        self.texts: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.finished: dict[str, dict[str, RequestOutput]] = {"caching": {}, "plain": {}}
        self.compared: set[str] = set()

    @initialize(
        texts=st.lists(
            st.lists(TOKENS, min_size=LONGEST, max_size=LONGEST), min_size=2, max_size=2
        ),
        max_tokens=MAX_TOKENS,
    )
    def shared_texts(self, texts: list[list[int]], max_tokens: int) -> None:
        """Two texts prompts are cut from; the first, whole, runs to completion first, so the
        cache starts with a prefix to find."""
        self.texts = texts
        self.submit(texts[0], max_tokens)
        while self.caching.has_unfinished() or self.plain.has_unfinished():
            self.step(1)

    @rule(target=live, data=st.data(), max_tokens=MAX_TOKENS)
    def add_request(self, data: st.DataObject, max_tokens: int) -> str:
        return self.submit(data.draw(prompts(self.texts, self.prompts), label="prompt"), max_tokens)

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        """Add the request to both engines; return its id."""
        request_id = f"r{len(self.prompts)}"
        self.prompts.append(prompt)
        params = SamplingParams(max_tokens=max_tokens)
        self.caching.add_request(prompt, params, request_id=request_id)
        self.plain.add_request(prompt, params, request_id=request_id)
        return request_id

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for name, llm in (("caching", self.caching), ("plain", self.plain)):
                self.finished[name].update({o.request_id: o for o in llm.step()})

    @rule(request_id=consumes(live))
    def abort(self, request_id: str) -> None:
        for name, llm in (("caching", self.caching), ("plain", self.plain)):
            output = llm.abort(request_id)
            if output is not None:
                self.finished[name][request_id] = output

    @invariant()
    def requests_both_finished_agree(self) -> None:
        both = self.finished["caching"].keys() & self.finished["plain"].keys()
        for request_id in sorted(both - self.compared):
            same_request(
                self.finished["caching"][request_id],
                self.finished["plain"][request_id],
                self.caching_executor.logits,
                self.plain_executor.logits,
            )
            self.compared.add(request_id)

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        check_block_accounting(self.caching)
        check_block_accounting(self.plain)

    def finish(self) -> EngineStats:
        """Run both engines until idle and compare every request; the caching engine's stats."""
        while self.caching.has_unfinished() or self.plain.has_unfinished():
            self.step(1)
        self.requests_both_finished_agree()
        assert len(self.compared) == len(self.prompts)
        stats = self.caching.stats()
        assert stats.free_blocks == stats.total_blocks and stats.free_rows == stats.total_rows
        return stats

    def teardown(self) -> None:
        stats = self.finish()
        cache = stats.prefix_cache
        assert cache is not None
        event("prefix hit" if cache.hits else "no prefix hit")
        event("evicted" if cache.evicted_blocks else "nothing evicted")
        event("preempted" if stats.preemptions else "not preempted")


CachingAgainstPlain.TestCase.settings = settings(
    settings(),
    max_examples=max(4, settings().max_examples // 4),
    stateful_step_count=30,
)
test_caching_engine_matches_plain_engine = CachingAgainstPlain.TestCase
