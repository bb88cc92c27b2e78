"""A runner as an executor that fills with NaN, before each step, every cache row whose contents
mean nothing, and records the logits each request sampled.

Meaningless rows: every row of a free block of either pool (given back, released past a lookback
and not kept by the prefix cache, or never used), and every row a running request holds but has
not written yet — its positions from ``num_computed`` on, and the entries of each compressed layer
not complete by then. A block the prefix cache evicts is handed to a request that has not
written it, so it is filled too. What the cache keeps (blocks nobody holds, with a key) is left
alone: a later hit reads it. So a step that reads a single meaningless row — a released or evicted
block, a cached prefix that lacks what its continuation reads, a block another request wrote
since — turns some logits to NaN, and the request fails.

Entries a query cannot see are read at weight zero (static shapes); the attention zeroes their
keys, so NaN there is harmless (``tests/engine/test_stale_cache_rows.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dsv4.cache import entry_rows_per_block, entry_stride
from dsv4.config import SLIDING
from runners.base import ModelRunner
from runners.engine import LLM, EngineLimits, ScheduledChunk
from runners.engine.request import Request

__all__ = ["NanFilled"]


class NanFilled:
    """``runner`` as a ``StepExecutor`` for one ``LLM`` (set ``llm`` before its first step)."""

    def __init__(self, runner: ModelRunner, *, limits: EngineLimits | None = None) -> None:
        self.runner = runner
        self.limits = runner.limits if limits is None else limits
        self.llm: LLM | None = None
        self.logits: dict[tuple[str, int], torch.Tensor] = {}
        """Each sampled row: by request id and index of the output token it was sampled for."""
        self.rows_filled = 0
        """Cache rows filled with NaN so far (all tensors of a layer count once)."""

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        assert self.llm is not None, "set NanFilled.llm to the engine it serves"
        scheduler = self.llm.scheduler
        self._fill_token_rows(
            [s for b in scheduler.blocks.free_ids() for s in self._block_slots(b)]
            + [s for r in scheduler.running for s in self._unwritten_slots(r)]
        )
        for index, layer_type in enumerate(self.runner.model.config.layer_types):
            if layer_type != SLIDING:
                self._fill_entry_rows(index, layer_type, scheduler.running)
        logits = self.runner.execute(chunks, token_ids)
        by_row = {r.row: r for r in scheduler.running}
        for i, chunk in enumerate(chunks):
            request = by_row[chunk.row]
            if chunk.start_position + chunk.num_tokens == len(request.token_ids):
                self.logits[request.request_id, request.num_output] = logits[i].clone()
        return logits

    def _block_slots(self, block: int) -> range:
        size = self.limits.block_size
        return range(block * size, (block + 1) * size)

    def _unwritten_slots(self, request: Request) -> Iterator[int]:
        size = self.limits.block_size
        for index, block in enumerate(request.block_ids, start=request.released):
            for offset in range(size):
                if index * size + offset >= request.num_computed:
                    yield block * size + offset

    def _fill_token_rows(self, slots: list[int]) -> None:
        if not slots:
            return
        rows = torch.tensor(slots, dtype=torch.int64, device=self.runner.device)
        for layer in self.runner.kv_caches.layers:
            for tensor in layer.token_tensors():
                tensor.index_fill_(0, rows, float("nan"))
        self.rows_filled += len(slots)

    def _fill_entry_rows(self, index: int, layer_type: str, running: Sequence[Request]) -> None:
        """NaN into the entry rows of layer ``index`` that hold nothing: those of free entry
        blocks, and those of running requests' entries not complete yet."""
        config = self.runner.model.config
        size, rate = self.limits.block_size, config.compress_rate(layer_type)
        stride = entry_stride(config, layer_type)
        per_block = entry_rows_per_block(stride, size)
        rows = [
            block * per_block + row
            for block in self.llm.scheduler.entry_blocks.free_ids()  # type: ignore[union-attr]
            for row in range(per_block)
        ]
        for request in running:
            capacity = -(-len(request.entry_block_ids) * size // stride)
            for entry in range(request.num_computed // rate, capacity):
                finest = entry * stride
                block = request.entry_block_ids[finest // size]
                rows.append(block * per_block + (finest % size) // (size // per_block))
        if rows:
            layer = self.runner.kv_caches.layers[index]
            at = torch.tensor(rows, dtype=torch.int64, device=self.runner.device)
            for tensor in layer.entry_tensors():
                tensor.index_fill_(0, at, float("nan"))
