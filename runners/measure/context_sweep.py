"""The context sweep: what a long maximum context and a long actual context cost.

- **Decode latency by actual context.** One request decodes one token at an actual context of
  ``C`` tokens (its cache blocks addressed as after a prefill of ``C - 1`` tokens; a step's
  cost does not depend on what the cache holds), with ``max_model_len`` set to the sweep's
  maximum, under each graph mode. The same step at the smallest context is also timed with
  ``max_model_len`` at the baseline (512): their ratio is what a large configured maximum costs
  a short request. Graphs are held for every context bucket, so every context replays a graph
  of its own bucket. Engines are timed interleaved, round-robin, as medians.
- **Prefill throughput** of one ``prefill_tokens``-token prompt, chunked through the engine.
- **Requests in flight at a fixed KV budget**: ``in_flight_requests`` requests of
  ``in_flight_prompt`` + ``in_flight_output`` tokens, eager, on an engine sized by that budget:
  the mean and most running per step, measured with block release and preemption, and with
  release switched off (an executor that hides its lookback); against the count the previous
  rules admitted, derived: one pool of token slots holding entries too, and a reservation of
  each request's worst case at admission (``min(rows, blocks // blocks_per_request)``).
- **KV cache bytes** of one layer of each type, in the model's compute dtype: per token of the
  block pool (window and compressor state, held for ``lookback`` positions) and per entry of
  the entry pool (one per ``entry_rate`` tokens, held while the request lives).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from dsv4.cache import cache_bytes, entry_rate, lookback
from dsv4.dtypes import dtype_name
from dsv4.model import DeepseekV4ForCausalLM
from runners.base import ModelRunner
from runners.capacity import CapacityError
from runners.engine import LLM, EngineLimits, SamplingParams, ScheduledChunk
from runners.engine.scheduler import RELEASED_BLOCK
from runners.measure.benchmark import timed
from runners.spec import Engine, EngineSpec, build_engine, build_model
from runners.threads import apply_threads

__all__ = ["SweepOptions", "run_context_sweep"]

MODES = {"eager": "NONE", "piecewise": "PIECEWISE", "full": "FULL_AND_PIECEWISE"}
"""Graph mode of each configuration, by name (a decode step replays FULL under the last)."""


@attrs.frozen(kw_only=True)
class SweepOptions:
    contexts: tuple[int, ...] = (32, 1024, 8192, 32768)
    max_model_len: int = 65536
    baseline_max_model_len: int = 512
    repeats: int = 20
    prefill_tokens: int = 32768
    prefill_chunk: int = 256
    """Tokens per prefill step (``max_num_batched_tokens``)."""
    block_size: int = 16
    threads: int | None = None
    """Torch CPU threads (``None``: the default for the model's size, ``runners.threads``)."""
    in_flight_budget: int = 4 * 2**20
    """Small enough that memory, not the token budget, bounds the requests in flight."""
    in_flight_requests: int = 12
    in_flight_prompt: int = 64
    in_flight_output: int = 448


def run_context_sweep(
    base: EngineSpec, options: SweepOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Measure (see the module docstring); ``CapacityError`` when the model declares fewer
    positions than the sweep needs."""
    progress("loading model")
    base = attrs.evolve(base, threads=options.threads)  # each engine built sets them again
    model = build_model(base)
    config = model.config
    threads = apply_threads(options.threads, config.hidden_size)
    longest = max(options.max_model_len, options.prefill_tokens + 1)
    if longest > config.max_position_embeddings or max(options.contexts) > options.max_model_len:
        raise CapacityError(
            f"the context sweep needs contexts up to {longest} tokens; this model declares "
            f"{config.max_position_embeddings} (try a checkpoint of 'dsv4 init-checkpoint "
            "--preset small', which declares 65536)"
        )
    latency = _decode_latency(base, model, options, progress)
    progress(f"prefill of {options.prefill_tokens} tokens")
    prefill = _prefill(base, model, options)
    progress(f"{options.in_flight_requests} requests at a {options.in_flight_budget} B budget")
    in_flight = _in_flight(base, model, options)
    per_type = cache_bytes(config, model.compute_dtype, options.block_size)
    return {
        "dtype": dtype_name(model.compute_dtype),
        "threads": threads,
        "max_model_len": options.max_model_len,
        "baseline_max_model_len": options.baseline_max_model_len,
        "decode": latency,
        "prefill": prefill,
        "in_flight": in_flight,
        "kv_bytes": {
            "per_layer_type": {
                name: {"per_token": sizes.per_token, "per_entry_block": sizes.per_entry_block}
                for name, sizes in per_type.items()
            },
            "layers": {t: config.layer_types.count(t) for t in per_type},
            "entry_rate": entry_rate(config),
            "block_size": options.block_size,
            "lookback": lookback(config),
        },
    }


def _engine(
    base: EngineSpec, model: DeepseekV4ForCausalLM, mode: str, max_model_len: int, block: int
) -> Engine:
    spec = attrs.evolve(
        base,
        cudagraph_mode=mode,
        max_model_len=max_model_len,
        max_num_seqs=1,
        block_size=block,
        capture_sizes=(1,),
        max_graph_contexts=64,
    )
    return build_engine(spec, model=model)


def _decode_chunk(context: int, limits: EngineLimits) -> ScheduledChunk:
    """The decode step of the token at ``context - 1`` of a request whose blocks before its
    lookback were released, as the engine would hand it over."""
    size, lookback = limits.block_size, limits.lookback or context
    released = max(0, context - lookback) // size
    live = -(-context // size) - released
    return ScheduledChunk(
        row=0,
        block_ids=(RELEASED_BLOCK,) * released + tuple(range(live)),
        start_position=context - 1,
        num_tokens=1,
        entry_block_ids=tuple(range(-(-(context // limits.entry_rate) // size))),
    )


def _decode_latency(
    base: EngineSpec,
    model: DeepseekV4ForCausalLM,
    options: SweepOptions,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Median decode-step microseconds per (engine, context), and the baseline ratios."""
    block = options.block_size
    shortest = min(options.contexts)
    runs: list[tuple[str, int, Engine, ScheduledChunk]] = []
    for name, mode in MODES.items():
        engine = _engine(base, model, mode, options.max_model_len, block)
        runs += [
            (name, c, engine, _decode_chunk(c, engine.runner.limits)) for c in options.contexts
        ]
        baseline = _engine(base, model, mode, options.baseline_max_model_len, block)
        runs.append(
            (
                f"{name}@baseline",
                shortest,
                baseline,
                _decode_chunk(shortest, baseline.runner.limits),
            )
        )
    token = [[1]]
    for name, context, engine, chunk in runs:  # warm up (and capture each bucket's graphs)
        progress(f"warming up {name} at context {context}")
        for _ in range(3):
            engine.runner.execute([chunk], token)
    samples: dict[tuple[str, int], list[float]] = {(n, c): [] for n, c, _, _ in runs}
    for round_index in range(options.repeats):
        progress(f"round {round_index + 1}/{options.repeats}")
        shift = round_index % len(runs)
        for name, context, engine, chunk in runs[shift:] + runs[:shift]:
            step = functools.partial(engine.runner.execute, [chunk], token)
            _, seconds = timed(step, engine.runner.device)
            samples[name, context].append(seconds)
    median_us = {key: statistics.median(s) * 1e6 for key, s in samples.items()}
    table = {
        name: {str(c): round(median_us[name, c], 1) for c in options.contexts} for name in MODES
    }
    ratios = {
        name: round(median_us[name, shortest] / median_us[f"{name}@baseline", shortest], 3)
        for name in MODES
    }
    return {
        "median_us": table,
        "baseline_median_us": {n: round(median_us[f"{n}@baseline", shortest], 1) for n in MODES},
        "shortest_context": shortest,
        "ratio_to_baseline": ratios,
    }


def _prefill(
    base: EngineSpec, model: DeepseekV4ForCausalLM, options: SweepOptions
) -> dict[str, Any]:
    spec = attrs.evolve(
        base,
        max_model_len=options.prefill_tokens + 1,
        max_num_seqs=1,
        block_size=options.block_size,
        max_num_tokens=options.prefill_chunk,
    )
    engine = build_engine(spec, model=model)
    vocab = model.config.vocab_size
    prompt = [(7 * i + 3) % min(vocab, 256) for i in range(options.prefill_tokens)]
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    _, seconds = timed(lambda: engine.llm.generate([prompt], params), engine.runner.device)
    return {
        "tokens": options.prefill_tokens,
        "chunk": options.prefill_chunk,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(options.prefill_tokens / seconds, 1),
        "kv_cache_bytes": engine.capacity.to_dict()["kv_cache_bytes"] if engine.capacity else None,
    }


class _WithoutRelease:
    """A runner as an executor that hides its lookback, so the engine releases nothing."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.limits = attrs.evolve(runner.limits, lookback=None)

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        return self.runner.execute(chunks, token_ids)


def _in_flight(
    base: EngineSpec, model: DeepseekV4ForCausalLM, options: SweepOptions
) -> dict[str, Any]:
    length = options.in_flight_prompt + options.in_flight_output
    spec = attrs.evolve(
        base,
        cudagraph_mode="NONE",
        max_model_len=length,
        max_num_seqs=options.in_flight_requests,
        block_size=options.block_size,
        kv_cache_memory=options.in_flight_budget,
    )
    engine = build_engine(spec, model=model)
    assert engine.capacity is not None
    vocab = min(256, model.config.vocab_size)
    prompts = [
        [(5 * r + 3 * i) % vocab for i in range(options.in_flight_prompt)]
        for r in range(options.in_flight_requests)
    ]
    params = SamplingParams(max_tokens=options.in_flight_output, ignore_eos=True)
    measured = {}
    for name, executor in (("released", engine.runner), ("kept", _WithoutRelease(engine.runner))):
        llm = LLM(executor)
        for prompt in prompts:
            llm.add_request(prompt, params)
        running: list[int] = []
        while llm.has_unfinished():
            llm.step()
            running.append(llm.stats().running)
        stats = llm.stats()
        measured[name] = {
            "mean_running": round(statistics.mean(running), 2),
            "peak_running": max(running),
            "steps": len(running),
            "preemptions": stats.preemptions,
            "released_blocks": stats.released_blocks,
        }
    plan = engine.capacity
    # the previous layout kept every entry in a token slot: one pool of both blocks' bytes
    one_pool_blocks = options.in_flight_budget // (plan.block_bytes + plan.entry_block_bytes)
    worst_case = -(-(length - 1) // options.block_size)
    return {
        "budget_bytes": options.in_flight_budget,
        "requests": options.in_flight_requests,
        "prompt": options.in_flight_prompt,
        "output": options.in_flight_output,
        "layout": plan.to_dict(),
        "measured": measured,
        "previous_rules": min(options.in_flight_requests, one_pool_blocks // worst_case),
    }
