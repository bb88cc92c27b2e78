"""Shared support for runner tests: tiny random models, runners built from resolutions, greedy
generation through the engine with every step's logits recorded.

Captures cost about a second each on the tape, so runners are built once per test module and
reused across hypothesis examples — which also makes every example replay graphs captured by
earlier ones ("across capture and many replays").
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from hypothesis import strategies as st

from dsv4.config import DeepseekV4Config
from dsv4.metadata import ScheduledChunk
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.weights import randomize_
from graphs import EagerRegionStrategy
from graphs.audit import AuditMode
from platforms import CpuPlatform, Platform
from runners import CacheLayout, CUDAGraphMode, ModelRunner, Resolution, resolve
from runners.engine import LLM, SamplingParams

DSV4 = "DeepseekV4ForCausalLM"
LAYOUT = CacheLayout(num_blocks=48, block_size=4, max_rows=4, max_blocks_per_row=8)
CAPTURE_SIZES = (1, 2, 4)
MAX_NUM_TOKENS = 16
STEP_BUDGET = 7
"""Tokens per engine step: prefill chunks of up to 7 tokens, so some mixed batches are padded
into a captured size and others (5..7 tokens) run eagerly above the largest one."""

prompts = st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=13), min_size=1, max_size=3)
"""Byte-level prompts of different lengths (crossing window and compression boundaries)."""
MIXED_BATCH = [list(range(40, 53)), [7, 7, 7, 9, 9, 9], [200]]
"""Prompts of 13, 6 and 1 tokens: chunked, padded and eager prefill steps, then decode."""


def fresh_model(seed: int = 0, device: str = "cpu") -> DeepseekV4ForCausalLM:
    """The built-in tiny configuration (all three layer types) with random unit-scale weights.

    Built anew each time (a runner binds its caches and eager region into the model it drives);
    the weights are a pure function of ``seed``.
    """
    torch.set_num_threads(1)
    config = DeepseekV4Config.tiny()
    model = DeepseekV4ForCausalLM(config, device=device)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    return model.eval()


def build_runner(
    resolution: Resolution,
    *,
    audit: AuditMode = "raise",
    capture_sizes: Sequence[int] = CAPTURE_SIZES,
    seed: int = 0,
) -> ModelRunner:
    return ModelRunner.from_resolution(
        resolution,
        fresh_model(seed, resolution.platform.device_type),
        layout=LAYOUT,
        capture_sizes=capture_sizes,
        max_num_tokens=MAX_NUM_TOKENS,
        audit=audit,
    )


def resolve_on(
    platform: Platform | None = None,
    *,
    runner: str | None = None,
    mode: CUDAGraphMode | str | None = None,
    region: EagerRegionStrategy | str | None = None,
    unsafe: bool = False,
) -> Resolution:
    return resolve(DSV4, platform or CpuPlatform(), runner, mode, region, unsafe, environ={})


class RecordingExecutor:
    """Delegates to a runner and keeps every step's logits (the engine's ``StepExecutor``)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.logits: list[torch.Tensor] = []
        self.max_rows = runner.max_rows
        self.max_num_tokens = runner.max_num_tokens
        self.num_blocks = runner.num_blocks
        self.block_size = runner.block_size
        self.max_blocks_per_row = runner.max_blocks_per_row
        self.vocab_size = runner.vocab_size

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        logits = self.runner.execute(chunks, token_ids)
        self.logits.append(logits.clone())
        return logits


@attrs.frozen
class Generation:
    tokens: list[tuple[int, ...]]
    step_logits: list[torch.Tensor]


def greedy(runner: ModelRunner, batch: Sequence[Sequence[int]], max_tokens: int) -> Generation:
    """Greedy generation through the engine; the outputs and every step's logits."""
    executor = RecordingExecutor(runner)
    llm = LLM(executor, max_num_batched_tokens=STEP_BUDGET)
    outputs = llm.generate(batch, SamplingParams(max_tokens=max_tokens))
    return Generation([tuple(o.output_ids) for o in outputs], executor.logits)


def max_logit_difference(a: Generation, b: Generation) -> float:
    assert len(a.step_logits) == len(b.step_logits)
    return max(
        float((x - y).abs().max()) for x, y in zip(a.step_logits, b.step_logits, strict=True)
    )
