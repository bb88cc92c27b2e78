"""Shared support for runner tests: the built-in tiny model, runners built from resolutions,
greedy generation through the engine with every step's logits recorded.

Captures cost about a second each on the tape, so runners are built once per test module and
reused across hypothesis examples — which also makes every example replay graphs captured by
earlier ones ("across capture and many replays").
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from dsv4.config import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.testing import prompt_batches, random_model
from graphs import EagerRegionStrategy
from graphs.audit import AuditMode
from platforms import CpuPlatform, Platform
from runners import CacheLayout, CUDAGraphMode, ModelRunner, Resolution, resolve
from runners.engine import LLM, SamplingParams, StepExecutor
from runners.measure.equivalence import RecordingExecutor
from runners.spec import build_runner

DSV4 = "DeepseekV4ForCausalLM"
LAYOUT = CacheLayout(num_blocks=48, block_size=4, max_rows=4, max_blocks_per_row=8)
CAPTURE_SIZES = (1, 2, 4)
MAX_NUM_TOKENS = 16
FIRST_CONTEXT_BUCKET = 8
"""Context buckets of 8, 16 and 32 tokens (``LAYOUT`` addresses 32): prompts and generations
cross bucket boundaries, so graphs of several context widths serve one request."""
STEP_BUDGET = 7
"""Tokens per engine step: prefill chunks of up to 7 tokens, so some mixed batches are padded
into a captured size and others (5..7 tokens) run eagerly above the largest one."""

prompts = prompt_batches(vocab_size=256)
"""Byte-level prompts of different lengths (crossing window and compression boundaries)."""
MIXED_BATCH = [list(range(40, 53)), [7, 7, 7, 9, 9, 9], [200]]
"""Prompts of 13, 6 and 1 tokens: chunked, padded and eager prefill steps, then decode."""


def fresh_model(seed: int = 0, device: str = "cpu") -> DeepseekV4ForCausalLM:
    """The built-in tiny configuration (all three layer types) with random unit-scale weights,
    a pure function of ``seed``."""
    return random_model(DeepseekV4Config.tiny(), seed, device)


def tiny_runner(
    resolution: Resolution,
    *,
    audit: AuditMode = "raise",
    capture_sizes: Sequence[int] = CAPTURE_SIZES,
    seed: int = 0,
    model: DeepseekV4ForCausalLM | None = None,
    max_graph_contexts: int = 4,
) -> ModelRunner:
    """The resolved runner over ``model`` (a fresh tiny model of ``seed`` if not given)."""
    if model is None:
        model = fresh_model(seed, resolution.platform.device_type)
    return build_runner(
        resolution,
        model,
        layout=LAYOUT,
        capture_sizes=capture_sizes,
        max_num_tokens=MAX_NUM_TOKENS,
        audit=audit,
        first_context_bucket=FIRST_CONTEXT_BUCKET,
        max_graph_contexts=max_graph_contexts,
    )


def resolve_on(
    platform: Platform | None = None,
    *,
    runner: str | None = None,
    mode: CUDAGraphMode | str | None = None,
    region: EagerRegionStrategy | str | None = None,
    unsafe: bool = False,
    tensor_parallel_size: int = 1,
) -> Resolution:
    return resolve(
        DSV4,
        platform or CpuPlatform(),
        runner,
        mode,
        region,
        unsafe,
        environ={},
        tensor_parallel_size=tensor_parallel_size,
    )


@attrs.frozen
class Generation:
    tokens: list[tuple[int, ...]]
    step_logits: list[torch.Tensor]


def greedy(runner: StepExecutor, batch: Sequence[Sequence[int]], max_tokens: int) -> Generation:
    """Greedy generation through the engine; the outputs and every step's logits."""
    executor = RecordingExecutor(runner)
    llm = LLM(executor, max_num_batched_tokens=STEP_BUDGET)
    outputs = llm.generate(batch, SamplingParams(max_tokens=max_tokens))
    return Generation(
        [tuple(o.output_ids) for o in outputs], [logits for _, logits in executor.steps]
    )


def max_logit_difference(a: Generation, b: Generation) -> float:
    assert len(a.step_logits) == len(b.step_logits)
    return max(
        float((x - y).abs().max()) for x, y in zip(a.step_logits, b.step_logits, strict=True)
    )


def captured_sizes(runner: ModelRunner) -> tuple[tuple[CUDAGraphMode, int], ...]:
    """The (mode, padded size) of each graph ``runner`` captured, in capture order."""
    return tuple((key.mode, key.num_tokens) for key in runner.captured)
