"""The engine over the real model runners on the built-in tiny model: greedy tokens equal a
reference that recomputes every token by a full prefill of its history on a separate model.

Chunked prefill (budget 16), fewer rows than requests (so a row and its blocks are reused),
prompts crossing the compressed windows, eager and replayed steps.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.testing import run_schedule
from dsv4.weights import randomize_
from graphs import EagerRegionStrategy, NarrowRegion, WideRegion
from platforms import CpuPlatform
from runners import CacheLayout, CUDAGraphMode, ModelRunner, ModelRunnerV1, ModelRunnerV2
from runners.engine import LLM, SamplingParams

torch.set_num_threads(1)

PROMPTS = [list(b"Hello, DeepSeek"), list(b"abc"), list(b"The quick brown fox jumps")]
MAX_TOKENS = 10


def tiny_model(strategy: EagerRegionStrategy) -> DeepseekV4ForCausalLM:
    config = DeepseekV4Config.tiny()
    model = DeepseekV4ForCausalLM(config, strategy=strategy)
    randomize_(model, 0, num_experts=config.n_routed_experts)
    return model


@pytest.fixture(scope="module")
def reference_tokens() -> list[tuple[int, ...]]:
    model = tiny_model(NarrowRegion())
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            history = list(prompt)
            for _ in range(MAX_TOKENS):
                (logits,) = run_schedule(model, [history], [[(0, len(history))]])
                history.append(int(logits[-1].argmax()))
            outputs.append(tuple(history[len(prompt) :]))
    return outputs


@pytest.mark.parametrize(
    ("runner_class", "decode", "mixed", "strategy"),
    [
        (ModelRunnerV2, CUDAGraphMode.NONE, CUDAGraphMode.NONE, NarrowRegion()),
        (ModelRunnerV2, CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, NarrowRegion()),
        (ModelRunnerV1, CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, WideRegion()),
    ],
    ids=["v2-eager", "v2-full-piecewise", "v1-piecewise-wide"],
)
def test_engine_over_runner_equals_full_recompute(
    runner_class: type[ModelRunner],
    decode: CUDAGraphMode,
    mixed: CUDAGraphMode,
    strategy: EagerRegionStrategy,
    reference_tokens: list[tuple[int, ...]],
) -> None:
    runner = runner_class(
        tiny_model(strategy),
        platform=CpuPlatform(),
        layout=CacheLayout(num_blocks=24, block_size=8, max_rows=2, max_blocks_per_row=6),
        decode_mode=decode,
        mixed_mode=mixed,
        capture_sizes=(1, 2, 4),
        max_num_tokens=32,
    )
    llm = LLM(runner, max_num_batched_tokens=16)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.output_ids for o in outputs] == reference_tokens
    stats = llm.stats()
    assert (stats.free_blocks, stats.free_rows) == (24, 2)
    replayed_modes = {mode for mode, _ in runner.captured}
    assert replayed_modes == {m for m in (decode, mixed) if m is not CUDAGraphMode.NONE}
