"""The engine over the real model runners on the built-in tiny model: greedy tokens equal a
reference that recomputes every token by a full prefill of its history on a separate model.

Chunked prefill (budget 16), fewer rows than requests (so a row and its blocks are reused),
prompts crossing the compressed windows, eager and replayed steps, and a cache small enough that
requests are preempted and recomputed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.testing import random_model, run_schedule
from graphs import EagerRegionStrategy, NarrowRegion, WideRegion
from platforms import CpuPlatform
from runners import CacheLayout, CUDAGraphMode, ModelRunner, ModelRunnerV1, ModelRunnerV2
from runners.engine import LLM, RequestFailedError, SamplingParams

PROMPTS = [list(b"Hello, DeepSeek"), list(b"abc"), list(b"The quick brown fox jumps")]
MAX_TOKENS = 10
LAYOUT = CacheLayout(num_blocks=24, block_size=8, max_rows=2, max_blocks_per_row=6)


def tiny_model() -> DeepseekV4ForCausalLM:
    return random_model(DeepseekV4Config.tiny(), 0)


@pytest.fixture(scope="module")
def reference_tokens() -> list[tuple[int, ...]]:
    model = tiny_model()
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
        tiny_model(),
        platform=CpuPlatform(),
        layout=CacheLayout(num_blocks=24, block_size=8, max_rows=2, max_blocks_per_row=6),
        eager_region=strategy,
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
    replayed_modes = {key.mode for key in runner.captured}
    assert replayed_modes == {m for m in (decode, mixed) if m is not CUDAGraphMode.NONE}


def v2_runner(model: DeepseekV4ForCausalLM, layout: CacheLayout = LAYOUT) -> ModelRunner:
    return ModelRunnerV2(
        model,
        platform=CpuPlatform(),
        layout=layout,
        eager_region=NarrowRegion(),
        decode_mode=CUDAGraphMode.FULL,
        mixed_mode=CUDAGraphMode.PIECEWISE,
        capture_sizes=(1, 2, 4),
        max_num_tokens=32,
    )


def test_a_request_the_model_turns_to_nan_fails_alone_and_its_blocks_are_reused_cleanly(
    reference_tokens: list[tuple[int, ...]],
) -> None:
    """A NaN embedding row poisons every request holding that token, and only those: the failed
    request's row and blocks (holding NaN KV) are reused by the next requests without effect."""
    unused = sorted(set(range(259, 320)) - {t for out in reference_tokens for t in out})
    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[unused[0]] = float("nan")
    llm = LLM(v2_runner(model), max_num_batched_tokens=16)
    with pytest.raises(RequestFailedError, match=r"^request '0' failed: its logits hold NaN") as e:
        llm.generate([[unused[0], 65, 66], *PROMPTS], SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.output_ids for o in e.value.outputs[1:]] == reference_tokens
    outputs = [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]
    assert outputs == reference_tokens


def test_preempted_requests_are_recomputed_through_the_runner_to_the_same_tokens(
    reference_tokens: list[tuple[int, ...]],
) -> None:
    """4 blocks of 8 tokens for 3 rows: a request holds at most 4 at once (its last 16 positions,
    the tiny model's lookback, and a chunk of 8, in blocks; earlier ones are released while it
    runs), so the 25-token prompt alone may need them all, and requests are preempted as they
    grow; one after generating tokens, so its prompt and those tokens are recomputed (across the
    compressed windows, by replayed graphs). Every output is the full recompute's."""
    layout = CacheLayout(num_blocks=4, block_size=8, max_rows=3, max_blocks_per_row=6)
    llm = LLM(v2_runner(tiny_model(), layout), max_num_batched_tokens=8)
    order = [0, 1, 2]
    ids = [llm.add_request(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS)) for i in order]
    outputs: dict[str, tuple[int, ...]] = {}
    generated_when_preempted = []
    while llm.has_unfinished():
        preemptions = llm.stats().preemptions
        outputs.update({o.request_id: o.output_ids for o in llm.step()})
        if llm.stats().preemptions > preemptions:
            newest = llm.scheduler.waiting[0].request_id
            generated_when_preempted.append(len(llm.generated(newest)))
    assert [outputs[i] for i in ids] == [reference_tokens[i] for i in order]
    assert max(generated_when_preempted) > 0
    stats = llm.stats()
    assert (stats.free_blocks, stats.free_rows) == (4, 3)
    assert stats.released_blocks > 0


def test_one_engine_over_a_runner_shared_by_two_threads(
    reference_tokens: list[tuple[int, ...]],
) -> None:
    """It used to fail most calls with "row 0: 0 token ids for 1" (steps interleaved)."""
    llm = LLM(v2_runner(tiny_model()), max_num_batched_tokens=16)
    start = threading.Barrier(2, timeout=30)

    def calls(_: int) -> list[list[tuple[int, ...]]]:
        start.wait()
        params = SamplingParams(max_tokens=MAX_TOKENS)
        return [[o.output_ids for o in llm.generate(PROMPTS, params)] for _ in range(3)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(calls, range(2)))
    assert results == [[reference_tokens] * 3] * 2
