"""No block is released while a layer can still read it.

The engine gives back the blocks of positions that left every layer's lookback while their
request runs (``Scheduler`` docstring). Here every free block of the position pool is filled with
NaN before each step, so a single read of a released (or any free) block turns that request's
logits to NaN; and every step's logits are compared, bit for bit, with a run of the same requests
on an engine that never releases anything. Pools are ample, so both runs schedule the same steps,
and freed blocks are handed out again first (the pool is last-in first-out).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4 import DeepseekV4Config
from dsv4.testing import random_model
from runners import CacheLayout, ModelRunner
from runners.engine import LLM, EngineLimits, SamplingParams, ScheduledChunk
from tests.engine.test_engine_over_runner import v2_runner

BLOCK = 4
LAYOUT = CacheLayout(num_blocks=64, block_size=BLOCK, max_rows=3, max_blocks_per_row=24)


class _Recorded:
    """The runner as an executor that records each step's logits; with ``poison``, it fills
    every free block of the position pool with NaN first; without ``release``, it hides the
    lookback so the engine releases nothing."""

    def __init__(self, runner: ModelRunner, *, release: bool) -> None:
        self.runner = runner
        self.limits: EngineLimits = (
            runner.limits if release else attrs.evolve(runner.limits, lookback=None)
        )
        self.free_blocks: Sequence[int] = ()
        self.logits: list[torch.Tensor] = []

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        for block in self.free_blocks:
            rows = slice(block * BLOCK, (block + 1) * BLOCK)
            for layer in self.runner.kv_caches.layers:
                for tensor in layer.token_tensors():
                    tensor[rows] = float("nan")
        logits = self.runner.execute(chunks, token_ids)
        self.logits.append(logits.clone())
        return logits


_RUNNERS = {
    name: v2_runner(random_model(DeepseekV4Config.tiny(), 3), LAYOUT)
    for name in ("releasing", "keeping")
}
"""Built once (captures are reused across examples); every example starts on fresh engines."""


def _generate(
    release: bool, prompts: list[list[int]], max_tokens: int, budget: int
) -> tuple[list[tuple[int, ...]], list[torch.Tensor], int]:
    executor = _Recorded(_RUNNERS["releasing" if release else "keeping"], release=release)
    llm = LLM(executor, max_num_batched_tokens=budget)
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    outputs: dict[str, tuple[int, ...]] = {}
    while llm.has_unfinished():
        executor.free_blocks = list(llm.scheduler.blocks._free) if release else ()
        outputs.update({o.request_id: o.output_ids for o in llm.step()})
    assert llm.stats().preemptions == 0  # ample pools: both runs schedule the same steps
    return (
        [outputs[k] for k in sorted(outputs, key=int)],
        executor.logits,
        (llm.stats().released_blocks),
    )


@settings(max_examples=6, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, 255), min_size=1, max_size=40), min_size=1, max_size=3
    ),
    max_tokens=st.integers(1, 12),
    budget=st.sampled_from([5, 8, 16]),
)
def test_released_blocks_are_never_read(
    prompts: list[list[int]], max_tokens: int, budget: int
) -> None:
    got, got_logits, released = _generate(True, prompts, max_tokens, budget)
    expected, expected_logits, kept = _generate(False, prompts, max_tokens, budget)
    assert kept == 0
    assert got == expected
    assert len(got_logits) == len(expected_logits)
    for step, (a, b) in enumerate(zip(got_logits, expected_logits, strict=True)):
        assert torch.equal(a, b), f"step {step} differs"
    longest = max(len(p) for p in prompts) + max_tokens - 1
    if longest >= 16 + 2 * BLOCK:  # past the lookback by a block: something was released
        assert released > 0
