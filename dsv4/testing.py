"""Drive the model through paged caches without a runner: a reference harness for tests.

``run_schedule`` teacher-forces a list of prompts through ``DeepseekV4ForCausalLM`` step by
step — each step a batch of chunks, one per request that still has tokens — and returns every
token's logits per prompt. With one chunk per prompt that is a batched prefill; with random
chunk sizes it is chunked prefill; with chunks of one it is token-by-token decode; prompts of
different lengths and chunkings put requests at different positions in the same batch. Blocks
and block-table rows are assigned in a shuffled order so paging is really exercised, and a
batch may be padded (padded tokens have slot -1).

Runners own scheduling for real; this module only exists so that tests (and their authors) can
compare cached paths against an uncached reference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from dsv4.cache import allocate_kv_caches
from dsv4.metadata import ScheduledChunk, new_metadata
from dsv4.model import DeepseekV4ForCausalLM
from graphs import ForwardContext, forward_context

__all__ = ["chunk_schedule", "run_schedule"]

Step = Sequence[tuple[int, int]]
"""One step: ``(request index, number of tokens)`` pairs, at most one per request."""


def chunk_schedule(chunk_sizes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """Steps where step ``s`` holds chunk ``s`` of every request that still has one."""
    steps: list[list[tuple[int, int]]] = []
    for s in range(max((len(c) for c in chunk_sizes), default=0)):
        steps.append([(r, sizes[s]) for r, sizes in enumerate(chunk_sizes) if s < len(sizes)])
    return steps


def run_schedule(
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    steps: Sequence[Step],
    *,
    block_size: int = 4,
    pad_to_multiple: int = 1,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Logits ``[len(prompt), vocab]`` of every prompt, computed through ``steps``."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    needs = [math.ceil(len(p) / block_size) for p in prompts]
    max_blocks = max(needs)
    pool = list(range(sum(needs) + 1))
    rng.shuffle(pool)
    blocks, start = [], 0
    for need in needs:
        blocks.append(tuple(pool[start : start + need]))
        start += need
    rows = list(range(len(prompts)))
    rng.shuffle(rows)
    caches = allocate_kv_caches(
        model.config,
        num_blocks=len(pool),
        block_size=block_size,
        device=device,
        dtype=next(model.parameters()).dtype,
    )
    model.bind_kv_caches(caches)

    done = [0] * len(prompts)
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        chunks: list[ScheduledChunk] = []
        ids: list[int] = []
        for request, count in step:
            begin = done[request]
            if count < 1 or begin + count > len(prompts[request]):
                raise ValueError(
                    f"step asks for tokens {begin}..{begin + count} of request {request}"
                )
            chunks.append(
                ScheduledChunk(
                    row=rows[request],
                    block_ids=blocks[request],
                    start_position=begin,
                    num_tokens=count,
                )
            )
            ids.extend(prompts[request][begin : begin + count])
            done[request] += count
        padded = math.ceil(len(ids) / pad_to_multiple) * pad_to_multiple
        metadata, positions = new_metadata(
            chunks,
            num_tokens=padded,
            block_size=block_size,
            max_rows=len(prompts),
            max_blocks=max_blocks,
            device=device,
        )
        input_ids = torch.tensor(ids + [0] * (padded - len(ids)), device=device)
        with torch.inference_mode(), forward_context(ForwardContext(attn_metadata=metadata)):
            logits = model(input_ids, positions)
        offset = 0
        for request, count in step:
            outputs[request].append(logits[offset : offset + count])
            offset += count
    unfinished = [r for r, p in enumerate(prompts) if done[r] != len(p)]
    if unfinished:
        raise ValueError(f"the schedule leaves requests {unfinished} unfinished")
    return [torch.cat(parts) for parts in outputs]
