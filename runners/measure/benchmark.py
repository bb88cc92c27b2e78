"""Measurements behind ``dsv4 bench``: decode-step latency, capture cost, generation throughput.

Method (every figure the README quotes is taken this way):
- Every interval is measured by ``timed``: work queued on the device before it is drained first,
  and the interval ends when the device has finished what the timed work queued (CUDA events on
  a GPU, the host's clock on the CPU), so no configuration is charged for another's kernels.
- Decode latency: one runner per configuration (eager, FULL, PIECEWISE narrow, PIECEWISE wide),
  each over its own copy of the same weights. For each thread count and batch size the same
  requests are prefilled in every runner, then single decode steps are timed *interleaved* —
  one step of each configuration per round, the starting configuration rotating — and the
  median per configuration is reported with ratios taken from those medians.
- Capture: seconds per captured (mode, size), and bytes held by all captures of a runner: the
  backend's shared arena, plus what each tape segment retains (storages the program still holds)
  and keeps as constants (``TapeSegment.memory``); unknown (``None``) where the pool reports no
  size, as CUDA's does. Compared with the peak of an eager step of the largest captured size
  whose context reaches the widest captured bucket (the most any one graph computes): live bytes
  of every storage an op newly allocates during the step, sampled after every op
  (``eager_step_peak_bytes``); memory made before the step (weights, caches, persistent
  buffers) is not counted, nor are views of it, as captures do not hold it either.
- Generation: greedy tokens per second of the engine (graphs captured beforehand) against
  ``transformers``' ``generate`` on the same weights and prompts, alternating rounds, medians.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import torch

from dsv4 import DeepseekV4ForCausalLM
from dsv4.metadata import entry_width
from graphs._ops import QuietDispatchMode
from graphs._tensor_refs import WeakStorage, storage_key
from graphs.allocations import new_allocations
from runners.base import ModelRunner
from runners.batch import GraphKey, StepReach
from runners.engine import SamplingParams, ScheduledChunk
from runners.spec import EngineSpec, build_engine

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_PROMPT_LEN",
    "CaptureCost",
    "DecodeLatency",
    "GenerationThroughput",
    "capture_cost",
    "captures_held_bytes",
    "decode_latency",
    "decode_runners",
    "decode_specs",
    "decode_token_ids",
    "eager_step_peak_bytes",
    "engine_throughput",
    "prefill_requests",
    "synchronize",
    "timed",
    "torch_threads",
]

T = TypeVar("T")

DECODE_CONFIGS: dict[str, tuple[str, str, str]] = {
    # name: (runner, graph mode, eager region)
    "eager": ("v2", "NONE", "auto"),
    "full": ("v2", "FULL_DECODE_ONLY", "auto"),
    "narrow": ("v2", "PIECEWISE", "narrow"),
    "wide": ("v2", "PIECEWISE", "wide"),
}


DECODE_PROMPT_LEN = 16
"""Tokens each request holds before the timed decode step (the step's token is at this
position)."""


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


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run every kernel queued on it (the CPU queues none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``work()``'s result and the seconds it took on ``device``, its queued kernels included.

    Work queued earlier is drained first, so none of it is charged here. On a ``cuda`` device
    (ROCm's included) the interval is a pair of timing events recorded around ``work`` on the
    current stream and read after synchronising: from when the device reached the first to when
    it had run everything ``work`` queued before the second. On the CPU, where ``work`` runs to
    completion before returning, it is the host's ``perf_counter``.
    """
    synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        result = work()
        return result, time.perf_counter() - start
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    result = work()
    end.record()
    synchronize(device)
    return result, begin.elapsed_time(end) / 1e3


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch on ``count`` CPU threads inside the block, then restore the count it had."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def prefill_requests(runner: ModelRunner, batch: int, prompt_len: int) -> list[ScheduledChunk]:
    """Prefill ``batch`` requests of ``prompt_len`` tokens; return their next decode chunks."""
    per_row = -(-(prompt_len + 1) // runner.layout.block_size)
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


def decode_token_ids(batch: int) -> list[list[int]]:
    """The token each of ``batch`` requests decodes in a timed step (one per request)."""
    return [[(5 * row + 1) % 256] for row in range(batch)]


def decode_latency(
    runners: dict[str, ModelRunner],
    *,
    batch_sizes: Sequence[int],
    threads: Sequence[int],
    repeats: int,
    prompt_len: int = DECODE_PROMPT_LEN,
    warmup: int = 3,
) -> list[DecodeLatency]:
    """Median decode-step latency of each runner, interleaved (see the module docstring)."""
    results = []
    names = list(runners)
    for count in threads:
        with torch_threads(count):
            for batch in batch_sizes:
                chunks = {
                    name: prefill_requests(r, batch, prompt_len) for name, r in runners.items()
                }
                ids = decode_token_ids(batch)
                for name, runner in runners.items():
                    for _ in range(warmup):
                        runner.execute(chunks[name], ids)
                samples: dict[str, list[float]] = {name: [] for name in names}
                for round_index in range(repeats):
                    shift = round_index % len(names)
                    for name in names[shift:] + names[:shift]:
                        runner = runners[name]
                        step = functools.partial(runner.execute, chunks[name], ids)
                        samples[name].append(timed(step, runner.device)[1])
                results.append(
                    DecodeLatency(
                        threads=count,
                        batch_size=batch,
                        median_us={n: statistics.median(s) * 1e6 for n, s in samples.items()},
                    )
                )
    return results


def decode_specs(spec: EngineSpec) -> dict[str, EngineSpec]:
    """``spec`` as each configuration of ``DECODE_CONFIGS``, by name."""
    return {
        name: attrs.evolve(spec, runner=runner, cudagraph_mode=mode, eager_region=region)
        for name, (runner, mode, region) in DECODE_CONFIGS.items()
    }


def decode_runners(
    spec: EngineSpec,
    model_factory: Callable[[], DeepseekV4ForCausalLM],
    names: Sequence[str] = tuple(DECODE_CONFIGS),
) -> dict[str, ModelRunner]:
    """One runner per configuration of ``DECODE_CONFIGS`` in ``names``, each over its own
    model copy."""
    return {
        name: build_engine(config, model=model_factory()).runner
        for name, config in decode_specs(spec).items()
        if name in names
    }


def capture_cost(runner: ModelRunner, reach: StepReach | None = None) -> CaptureCost:
    """Capture every size of ``runner`` (not yet captured; with ``reach``, those its steps can
    replay, as ``dsv4 run`` does), timing each graph; then the bytes its captures hold
    (``captures_held_bytes``)."""
    timings: list[tuple[str, int, float]] = []

    def on_captured(key: GraphKey, seconds: float) -> None:
        timings.append((key.mode.name, key.num_tokens, seconds))

    _, seconds = timed(lambda: runner.capture(on_captured, reach=reach), runner.device)
    return CaptureCost(
        seconds_per_graph=tuple(timings),
        total_seconds=seconds,
        held_bytes=captures_held_bytes(runner),
    )


class _PeakLiveBytes(QuietDispatchMode):
    """Live bytes of the storages ops allocate while active, and their peak after any op.

    Only new allocations count (``graphs.allocations.new_allocations``: outputs whose storage
    no input shares): a view of memory made before (a weight's transpose, a slice of a KV
    cache) allocates nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[WeakStorage, int]] = {}
        self.peak = 0

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = func(*args, **kwargs)
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        for t in new_allocations(func, args, kwargs, result):
            key = storage_key(t)
            if key not in self._live:
                storage = t.untyped_storage()
                self._live[key] = (WeakStorage(storage), storage.nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self._live.values()))
        return result


def eager_step_peak_bytes(runner: ModelRunner, num_tokens: int, width: int) -> int:
    """Peak live bytes allocated by one eager step of ``num_tokens`` prompt tokens on ``runner``
    (whose graph mode should be ``NONE``) whose context reaches ``width`` blocks, as a graph of
    that size and context bucket attends: each row's chunk ends at the last position of its
    ``width`` blocks (rows of at most ``width`` blocks' tokens each). Block ids wrap around the
    pools (a request as wide as the widest bucket need not fit in them: only addresses matter
    to the memory a step allocates)."""
    layout = runner.layout
    reach = width * layout.block_size
    entry_blocks = entry_width(width, runner.entry_rate)
    chunks, ids = [], []
    for row, start in enumerate(range(0, num_tokens, reach)):
        count = min(reach, num_tokens - start)
        blocks = range(row * width, (row + 1) * width)
        entries = range(row * entry_blocks, (row + 1) * entry_blocks)
        chunks.append(
            ScheduledChunk(
                row=row,
                block_ids=tuple(b % layout.num_blocks for b in blocks),
                start_position=reach - count,
                num_tokens=count,
                entry_block_ids=tuple(b % layout.num_entry_blocks for b in entries),
            )
        )
        ids.append([(3 * i + row) % runner.vocab_size for i in range(count)])
    tracker = _PeakLiveBytes()
    with tracker:
        runner.execute(chunks, ids)
    return tracker.peak


def captures_held_bytes(runner: ModelRunner) -> int | None:
    """Bytes held by every capture of ``runner``: its backend's arena plus what each segment
    retains and keeps as constants; ``None`` where segments do not report memory (CUDA)."""
    pool_bytes = getattr(runner.graph_backend.pool, "nbytes", None)
    if pool_bytes is None:
        return None
    held = int(pool_bytes)
    for graph in runner._graphs.values():
        for segment in graph.capture.segments:
            memory = getattr(segment, "memory", None)
            if memory is not None:
                held += memory.retained_bytes + memory.constant_bytes
    return held


def engine_throughput(
    spec: EngineSpec,
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> tuple[Callable[[], GenerationThroughput], list[list[int]], CaptureCost]:
    """A timed greedy-generation round of the engine, its tokens, and the capture made first:
    the graphs ``dsv4 run`` captures for these prompts (``StepReach``)."""
    engine = build_engine(spec, model=model)
    reach = StepReach.of_requests([len(p) for p in prompts], max_new_tokens)
    capture = capture_cost(engine.runner, reach)
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
    outputs = engine.llm.generate(prompts, params)

    def round_() -> GenerationThroughput:
        result, seconds = timed(lambda: engine.llm.generate(prompts, params), engine.runner.device)
        return GenerationThroughput(tokens=sum(len(o.output_ids) for o in result), seconds=seconds)

    return round_, [list(o.output_ids) for o in outputs], capture
