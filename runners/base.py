"""The ``ModelRunner`` ABC: persistent inputs, owned caches, capture sizes and dispatch.

One step: ``execute(chunks, token_ids)`` classifies the batch (uniform decode or mixed), picks
the basic graph mode for that kind, pads the token count to the next capture size, captures the
graph for that (mode, size) if it does not exist yet, writes the step's inputs and attention
metadata, and replays — or runs eagerly under mode ``NONE`` or above the largest capture size.
It returns the logits of each chunk's last token.

Invariants:
- ``input_ids`` and ``positions`` are persistent buffers sized to the token budget; every step
  (eager, capture or replay) reads slices of them, so captured work reads them at fixed addresses.
- The runner owns the paged KV caches and binds them to the model once.
- A graph is captured with *dummy* metadata (all tokens padding, slot -1: nothing is written to
  the caches) before the step's real metadata is written; replays see the real metadata only
  where the runner's metadata is address-stable (V2) or read eagerly (V1's wide region).
- The forward context (metadata, batch descriptor, runtime mode) is set for exactly one step.
- FULL graphs serve uniform-decode batches only; mixed batches never run under FULL.
- Subclasses differ only in how metadata is built (``_write_metadata``) and which extra memory is
  static (``_static_metadata``); the region each requires is a class attribute.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from dsv4.metadata import AttentionMetadata, ScheduledChunk
from graphs.capture import BreakableCapture
from graphs.forward_context import ForwardContext, forward_context
from graphs.strategies import EagerRegionStrategy
from platforms.base import Platform
from runners.batch import DEFAULT_CAPTURE_SIZES, BatchDescriptor, CaptureSizes
from runners.errors import RunnerInputError
from runners.modes import CUDAGraphMode
from runners.static_memory import audited_capture

if TYPE_CHECKING:
    from dsv4.cache import PagedKVCaches
    from dsv4.model import DeepseekV4ForCausalLM

__all__ = ["CacheLayout", "CapturedGraph", "ModelRunner"]


@attrs.frozen(kw_only=True)
class CacheLayout:
    """Shape of the paged caches and the block table a runner allocates."""

    num_blocks: int = attrs.field(validator=attrs.validators.gt(0))
    block_size: int = attrs.field(validator=attrs.validators.gt(0))
    max_rows: int = attrs.field(validator=attrs.validators.gt(0))
    """Requests that can be in flight at once (rows of the block table)."""
    max_blocks_per_row: int = attrs.field(validator=attrs.validators.gt(0))

    @property
    def max_context(self) -> int:
        return self.max_blocks_per_row * self.block_size


@attrs.frozen(kw_only=True)
class CapturedGraph:
    """One captured step: the capture to replay and the logits tensor it writes."""

    mode: CUDAGraphMode
    num_tokens: int
    capture: BreakableCapture
    logits: torch.Tensor


class ModelRunner(abc.ABC):
    """Runs a model one step at a time under the graph modes a resolution chose."""

    name: ClassVar[str]
    """Short name (``v1``, ``v2``) used by ``DSV4_RUNNER``, the CLI and reasons."""
    eager_region_strategy: ClassVar[EagerRegionStrategy]
    """The narrowest eager region under which this runner's captures replay correctly."""
    eager_region_reason: ClassVar[str]

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        *,
        platform: Platform,
        layout: CacheLayout,
        decode_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        mixed_mode: CUDAGraphMode = CUDAGraphMode.PIECEWISE,
        capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
        max_num_tokens: int = 256,
        audit: bool = True,
    ) -> None:
        for kind, mode in (("decode", decode_mode), ("mixed", mixed_mode)):
            if not mode.is_basic:
                raise ValueError(f"the {kind} mode must be NONE, PIECEWISE or FULL, not {mode}")
        if mixed_mode is CUDAGraphMode.FULL:
            raise ValueError("FULL graphs serve uniform-decode batches only; use PIECEWISE")
        platform.require_available()
        self.platform = platform
        self.device = platform.device
        self.model = model
        self.layout = layout
        self.decode_mode = decode_mode
        self.mixed_mode = mixed_mode
        self.max_num_tokens = max_num_tokens
        self.capture_sizes = CaptureSizes.of(capture_sizes, max_num_tokens=max_num_tokens)
        self.audit = audit
        self.vocab_size: int = model.config.vocab_size
        from dsv4.cache import allocate_kv_caches

        dtype = next(model.parameters()).dtype
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.kv_caches: PagedKVCaches = allocate_kv_caches(
            model.config,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            device=self.device,
            dtype=dtype,
        )
        model.bind_kv_caches(self.kv_caches)
        self._backend = platform.graph_backend()
        self._graphs: dict[tuple[CUDAGraphMode, int], CapturedGraph] = {}

    # -- subclass hooks --------------------------------------------------------------------------
    @abc.abstractmethod
    def _write_metadata(
        self, chunks: Sequence[ScheduledChunk], num_tokens: int
    ) -> AttentionMetadata:
        """Metadata for ``chunks`` padded to ``num_tokens``; also fills ``positions[:T]``."""

    @abc.abstractmethod
    def _static_metadata(self) -> tuple[torch.Tensor, ...]:
        """Metadata memory that stays at fixed addresses across steps (none for V1)."""

    # -- public API ------------------------------------------------------------------------------
    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Run one step; return ``[len(chunks), vocab]`` fp32 logits of each chunk's last token."""
        num_tokens = self._validate(chunks, token_ids)
        uniform = all(chunk.num_tokens == 1 for chunk in chunks)
        mode = self.decode_mode if uniform else self.mixed_mode
        padded = self.capture_sizes.padded(num_tokens)
        if mode is CUDAGraphMode.NONE or padded is None:
            mode, padded = CUDAGraphMode.NONE, num_tokens
        graph = None if mode is CUDAGraphMode.NONE else self._graph(mode, padded)
        flat = [t for ids in token_ids for t in ids]
        self.input_ids[:num_tokens].copy_(torch.tensor(flat, dtype=torch.int64))
        self.input_ids[num_tokens:padded].zero_()
        metadata = self._write_metadata(chunks, padded)
        ctx = ForwardContext(
            attn_metadata=metadata,
            batch_descriptor=BatchDescriptor(num_tokens=padded, uniform_decode=uniform),
            runtime_mode=mode,
        )
        with forward_context(ctx), torch.inference_mode():
            if graph is None:
                logits = self.model(self.input_ids[:padded], self.positions[:padded])
            else:
                graph.capture.replay()
                logits = graph.logits
            ends = torch.tensor(_last_token_indices(chunks), device=logits.device)
            return logits.index_select(0, ends)

    def capture(self) -> None:
        """Capture every (mode, size) this runner can dispatch to, largest size first."""
        for size in self.capture_sizes.largest_first():
            for mode in self._capturing_modes():
                self._graph(mode, size)

    def clear_graphs(self) -> None:
        """Drop every captured graph; the next steps capture again."""
        self._graphs.clear()

    @property
    def captured(self) -> tuple[tuple[CUDAGraphMode, int], ...]:
        """The (mode, padded size) keys captured so far, in capture order."""
        return tuple(self._graphs)

    @property
    def num_graphs(self) -> int:
        return sum(g.capture.num_graphs for g in self._graphs.values())

    @property
    def num_eager_breaks(self) -> int:
        return sum(g.capture.num_eager_breaks for g in self._graphs.values())

    def static_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor captured work may read at a fixed address besides model weights."""
        return (self.input_ids, self.positions, *self.kv_caches.tensors(), *self._static_metadata())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(platform={self.platform.name}, decode={self.decode_mode.name}, "
            f"mixed={self.mixed_mode.name}, sizes={self.capture_sizes.sizes}, "
            f"captured={len(self._graphs)})"
        )

    # -- internals ---------------------------------------------------------------------------------
    def _capturing_modes(self) -> list[CUDAGraphMode]:
        modes = {self.decode_mode, self.mixed_mode} - {CUDAGraphMode.NONE}
        return sorted(modes, key=lambda m: m.value)

    def _graph(self, mode: CUDAGraphMode, size: int) -> CapturedGraph:
        key = (mode, size)
        if key not in self._graphs:
            self._graphs[key] = self._capture_one(mode, size)
        return self._graphs[key]

    def _capture_one(self, mode: CUDAGraphMode, size: int) -> CapturedGraph:
        """Capture one step of ``size`` padding tokens: dummy metadata, nothing written."""
        self.input_ids[:size].zero_()
        metadata = self._write_metadata((), size)
        ctx = ForwardContext(
            attn_metadata=metadata,
            batch_descriptor=BatchDescriptor(
                num_tokens=size, uniform_decode=mode is CUDAGraphMode.FULL
            ),
            runtime_mode=mode,
        )
        inputs = (self.input_ids[:size], self.positions[:size])
        with forward_context(ctx), torch.inference_mode():
            if self.device.type == "cuda":
                self.model(*inputs)  # warm-up: lazy library initialisation is not capturable
            with audited_capture(self, full=mode is CUDAGraphMode.FULL) as capture:
                logits = self.model(*inputs)
        return CapturedGraph(mode=mode, num_tokens=size, capture=capture, logits=logits)

    def _validate(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> int:
        if not chunks:
            raise RunnerInputError("a step needs at least one scheduled chunk")
        if len(token_ids) != len(chunks):
            raise RunnerInputError(
                f"{len(token_ids)} token-id lists for {len(chunks)} chunks; give one per chunk"
            )
        rows = [chunk.row for chunk in chunks]
        if len(set(rows)) != len(rows):
            raise RunnerInputError(f"block-table rows repeat within one step: {rows}")
        for chunk, ids in zip(chunks, token_ids, strict=True):
            if len(ids) != chunk.num_tokens:
                raise RunnerInputError(
                    f"row {chunk.row}: {len(ids)} token ids for a chunk of {chunk.num_tokens}"
                )
            if not 0 <= chunk.row < self.layout.max_rows:
                raise RunnerInputError(
                    f"row {chunk.row} outside the block table's {self.layout.max_rows} rows"
                )
            if any(not 0 <= b < self.layout.num_blocks for b in chunk.block_ids):
                raise RunnerInputError(
                    f"row {chunk.row}: block ids {chunk.block_ids} outside "
                    f"0..{self.layout.num_blocks - 1}"
                )
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise RunnerInputError(
                    f"row {chunk.row}: token ids outside the vocabulary 0..{self.vocab_size - 1}"
                )
        total = sum(chunk.num_tokens for chunk in chunks)
        if total > self.max_num_tokens:
            raise RunnerInputError(
                f"{total} tokens exceed the runner's token budget {self.max_num_tokens}"
            )
        return total


def _last_token_indices(chunks: Sequence[ScheduledChunk]) -> list[int]:
    ends, offset = [], 0
    for chunk in chunks:
        offset += chunk.num_tokens
        ends.append(offset - 1)
    return ends
