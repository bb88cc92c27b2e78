"""Measurements behind ``dsv4 bench``: decode-step latency, capture cost, generation throughput.

Method (every figure the README quotes is taken this way):
- Decode latency: one runner per configuration (eager, FULL, PIECEWISE narrow, PIECEWISE wide),
  each over its own copy of the same weights. For each thread count and batch size the same
  requests are prefilled in every runner, then single decode steps are timed *interleaved* —
  one step of each configuration per round, the starting configuration rotating — and the
  median per configuration is reported with ratios taken from those medians.
- Capture: seconds per captured (mode, size), and bytes held by all captures of a runner.
- Generation: greedy tokens per second of the engine (graphs captured beforehand) against
  ``transformers``' ``generate`` on the same weights and prompts, alternating rounds, medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from dsv4 import DeepseekV4ForCausalLM
from dsv4.metadata import ScheduledChunk
from runners.base import ModelRunner
from runners.engine import SamplingParams
from runners.serving import EngineSpec, build_engine

__all__ = [
    "DECODE_CONFIGS",
    "CaptureCost",
    "DecodeLatency",
    "GenerationThroughput",
    "capture_cost",
    "decode_latency",
    "engine_throughput",
]

DECODE_CONFIGS: dict[str, tuple[str, str, str]] = {
    # name: (runner, graph mode, eager region)
    "eager": ("v2", "NONE", "auto"),
    "full": ("v2", "FULL_DECODE_ONLY", "auto"),
    "narrow": ("v2", "PIECEWISE", "narrow"),
    "wide": ("v2", "PIECEWISE", "wide"),
}


@attrs.frozen(kw_only=True)
class DecodeLatency:
    threads: int
    batch_size: int
    median_us: dict[str, float]

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.median_us[numerator] / self.median_us[denominator]


@attrs.frozen(kw_only=True)
class CaptureCost:
    seconds_per_graph: tuple[tuple[str, int, float], ...]
    total_seconds: float
    held_bytes: int | None


@attrs.frozen(kw_only=True)
class GenerationThroughput:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _prefill(runner: ModelRunner, batch: int, prompt_len: int) -> list[ScheduledChunk]:
    """Prefill ``batch`` requests of ``prompt_len`` tokens; return their next decode chunks."""
    per_row = -(-(prompt_len + 1) // runner.block_size)
    decode = []
    for row in range(batch):
        blocks = tuple(range(row * per_row, (row + 1) * per_row))
        prompt = [(7 * row + 3 * i) % runner.vocab_size for i in range(prompt_len)]
        chunk = ScheduledChunk(row=row, block_ids=blocks, start_position=0, num_tokens=prompt_len)
        runner.execute([chunk], [prompt])
        decode.append(
            ScheduledChunk(row=row, block_ids=blocks, start_position=prompt_len, num_tokens=1)
        )
    return decode


def decode_latency(
    runners: dict[str, ModelRunner],
    *,
    batch_sizes: Sequence[int],
    threads: Sequence[int],
    repeats: int,
    prompt_len: int = 16,
    warmup: int = 3,
) -> list[DecodeLatency]:
    """Median decode-step latency of each runner, interleaved (see the module docstring)."""
    results = []
    names = list(runners)
    previous_threads = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            for batch in batch_sizes:
                chunks = {name: _prefill(r, batch, prompt_len) for name, r in runners.items()}
                ids = [[(5 * row + 1) % 256] for row in range(batch)]
                for name, runner in runners.items():
                    for _ in range(warmup):
                        runner.execute(chunks[name], ids)
                samples: dict[str, list[float]] = {name: [] for name in names}
                for round_index in range(repeats):
                    shift = round_index % len(names)
                    for name in names[shift:] + names[:shift]:
                        start = time.perf_counter()
                        runners[name].execute(chunks[name], ids)
                        samples[name].append(time.perf_counter() - start)
                results.append(
                    DecodeLatency(
                        threads=count,
                        batch_size=batch,
                        median_us={n: statistics.median(s) * 1e6 for n, s in samples.items()},
                    )
                )
    finally:
        torch.set_num_threads(previous_threads)
    return results


def decode_runners(
    spec: EngineSpec, model_factory: Callable[[], DeepseekV4ForCausalLM]
) -> dict[str, ModelRunner]:
    """One runner per configuration of ``DECODE_CONFIGS``, each over its own model copy."""
    return {
        name: build_engine(
            attrs.evolve(spec, runner=runner, cudagraph_mode=mode, eager_region=region),
            model=model_factory(),
        ).runner
        for name, (runner, mode, region) in DECODE_CONFIGS.items()
    }


def capture_cost(runner: ModelRunner, held_bytes: Callable[[], int | None]) -> CaptureCost:
    """Capture every size of ``runner`` (not yet captured), timing each graph."""
    timings: list[tuple[str, int, float]] = []
    start = time.perf_counter()
    runner.capture(lambda mode, size, seconds: timings.append((mode.name, size, seconds)))
    return CaptureCost(
        seconds_per_graph=tuple(timings),
        total_seconds=time.perf_counter() - start,
        held_bytes=held_bytes(),
    )


def engine_throughput(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> tuple[Callable[[], GenerationThroughput], list[list[int]]]:
    """A timed greedy-generation round of the engine (graphs captured first), and its tokens."""
    engine = build_engine(spec, model=model)
    engine.runner.capture()
    params = SamplingParams(max_tokens=max_new_tokens)
    outputs = engine.llm.generate(prompts, params)

    def round_() -> GenerationThroughput:
        start = time.perf_counter()
        result = engine.llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        return GenerationThroughput(tokens=sum(len(o.output_ids) for o in result), seconds=seconds)

    return round_, [list(o.output_ids) for o in outputs]
