"""A prefix-cache hit computes exactly what a run without the cache computes when its prefill
is chunked where the hit ends: every logit is bit for bit equal.

One request ``A`` runs alone, then ``B``, which shares a prefix with it, on two engines over
one runner: with the cache, ``B`` starts at the hit ``P`` (a multiple of the boundary, 8 here);
without it, ``B`` computes from 0 in chunks of ``P`` tokens (the token budget is ``P`` on both
engines, so ``A`` is chunked alike and leaves the same bits in the blocks ``B`` shares). The
steps after ``P`` are then the same computation on the same values, whatever the runner, graph
mode or dtype; anything a hit restored wrong, or read from a meaningless row (``NanFilled``
fills them with NaN on both engines), would show in some bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dsv4 import DeepseekV4ForCausalLM
from dsv4.weights import randomize_
from runners import CacheLayout, ModelRunner, SamplingParams
from runners.engine import LLM
from runners.spec import EngineSpec, build_engine
from tests.engine.nan_filled import NanFilled
from tests.engine.test_prefix_cache_lockstep import CONFIG

BOUNDARY = 8
LAYOUT = CacheLayout(num_blocks=40, block_size=2, max_rows=2, max_blocks_per_row=20)
CONFIGURATIONS = {
    "v2 eager": ("v2", "NONE", torch.float32),
    "v2 full+piecewise": ("v2", "FULL_AND_PIECEWISE", torch.float32),
    "v1 piecewise": ("v1", "PIECEWISE", torch.float32),
    "v2 full+piecewise bf16": ("v2", "FULL_AND_PIECEWISE", torch.bfloat16),
}


def _runner(runner: str, mode: str, dtype: torch.dtype) -> ModelRunner:
    model = DeepseekV4ForCausalLM(CONFIG, dtype=dtype)
    randomize_(model, 5, num_experts=CONFIG.n_routed_experts)
    spec = EngineSpec(
        platform="cpu",
        runner=runner,
        cudagraph_mode=mode,
        capture_sizes=(1, 2, 4, 8),
        max_num_tokens=24,
        layout=LAYOUT,
    )
    engine = build_engine(spec, model=model)
    assert engine.runner.limits.prefix_boundary == BOUNDARY
    return engine.runner


RUNNERS = {name: _runner(*choice) for name, choice in CONFIGURATIONS.items()}
TOKENS = st.integers(0, CONFIG.vocab_size - 1)


def _generate(
    runner: ModelRunner, caching: bool, budget: int, prompts: list[list[int]]
) -> tuple[dict[tuple[str, int], torch.Tensor], int]:
    """Each prompt alone, in turn; the logits each sampled, and the tokens the cache found."""
    executor = NanFilled(runner)
    llm = LLM(executor, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    executor.llm = llm
    for index, prompt in enumerate(prompts):
        llm.generate([prompt], SamplingParams(max_tokens=4))
        assert not llm.has_unfinished(), index
    stats = llm.stats().prefix_cache
    return executor.logits, 0 if stats is None else stats.hit_tokens


@pytest.mark.parametrize("name", CONFIGURATIONS)
@settings(max_examples=max(2, settings().max_examples // 8))
@given(
    shared=st.lists(TOKENS, min_size=9, max_size=24),
    a_own=st.lists(TOKENS, max_size=4),
    b_own=st.lists(TOKENS, min_size=1, max_size=8),
    data=st.data(),
)
def test_a_hit_equals_a_prefill_chunked_where_it_ends(
    name: str, shared: list[int], a_own: list[int], b_own: list[int], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(BOUNDARY, len(shared)), label="B shares")
    first, second = shared + a_own, shared[:cut] + b_own
    common = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )
    assume(common < len(first))  # else B might also share A's output tokens
    hit = min(common, len(second) - 1) // BOUNDARY * BOUNDARY
    runner = RUNNERS[name]
    cached, found = _generate(runner, True, hit, [first, second])
    chunked, none = _generate(runner, False, hit, [first, second])
    assert (found, none) == (hit, 0)
    assert cached.keys() == chunked.keys()
    for key, logits in cached.items():
        assert torch.equal(logits, chunked[key]), f"{name}: {key} differs"
