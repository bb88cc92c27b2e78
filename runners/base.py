"""The ``ModelRunner`` ABC: persistent inputs, owned caches, capture sizes and dispatch.

One step: ``execute(chunks, token_ids)`` classifies the batch (uniform decode or mixed), picks
the basic graph mode for that kind, pads the token count to the next capture size and the
context to the next context bucket, captures the graph for that (mode, size, bucket) if it does
not exist yet, writes the step's inputs and attention metadata, and replays — or runs eagerly,
at the step's exact context width, under mode ``NONE``, above the largest capture size, or in a
bucket beyond the ones graphs are held for. It returns the logits of each chunk's last token. A
runner satisfies the engine's ``StepExecutor`` protocol.

Invariants:
- ``input_ids`` and ``positions`` are persistent buffers sized to the token budget; every step
  (eager, capture or replay) reads slices of them, so captured work reads them at fixed addresses.
- The paged KV caches are in the model's ``compute_dtype`` (never the dtype of whichever
  parameter comes first: some stay float32 in every dtype).
- The runner owns the paged KV caches and its eager region; the model keeps neither. Both reach
  the model through the forward context, with the step's metadata, for exactly one step (every
  eager step and every capture), so runners over one shared model may run in turn.
- A graph is captured with dummy metadata before the step's real metadata is written (see
  ``runners.captured``); replays see the real metadata only where the runner's metadata is
  address-stable (V2) or read eagerly (V1's wide region). The capture audit checks exactly that.
- The runner's graphs share one backend and its memory pool; the pool is fresh per runner, and
  the runner takes a new backend (a fresh pool) whenever its pool is retired — after
  ``clear_graphs`` — since a pool is never recorded into again once its graphs are gone, and
  after any failed capture, whatever failed (its graphs captured before keep the old one).
  Within a context bucket, graphs are captured largest size first (also when captured lazily),
  so smaller captures reuse the pool memory of larger ones; ``capture`` takes the buckets it
  holds largest first too.
- Graphs are held for at most ``max_graph_contexts`` context buckets (the smallest ones when
  captured ahead of time, otherwise the first ones used); a step in any other bucket runs
  eagerly at its exact width, so its cost still follows its actual context.
- Host inputs reach the device through ``stage_into`` (pinned, non-blocking on a GPU).
- The model's forward and captures run as device work (``platforms.host_tensors.device_work``):
  a simulated GPU run's host-tensor tracking stands aside there.
- FULL graphs serve uniform-decode batches only; mixed batches never run under FULL. So FULL
  graphs are captured only for the sizes a batch of at most ``layout.max_rows`` tokens (one per
  request in flight) pads to (``CaptureSizes.serving``); above them one could never replay.
  Likewise a mode serving mixed batches only is not captured at size 1 (a mixed batch has two
  tokens or more).
- Subclasses differ only in how metadata is built (``_write_metadata``) and which metadata memory
  is static (``_static_metadata``); the region each requires is a class attribute.
- What the engine may schedule is one value, ``limits`` (``EngineLimits``), fixed at construction.

A runner is built from a resolution with ``runners.spec.build_runner``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import torch

from dsv4.cache import allocate_kv_caches, entry_rate, lookback, prefix_boundary
from dsv4.metadata import AttentionMetadata, stage_into
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.panels import PanelCopies
from graphs.audit import AuditFinding, AuditMode
from graphs.backend import GraphBackend, PoolGraphs
from graphs.forward_context import ForwardContext, forward_context
from graphs.heap import collector_paused
from graphs.strategies import EagerRegionStrategy
from platforms.base import Platform
from platforms.host_tensors import device_work
from runners.batch import (
    DEFAULT_CAPTURE_SIZES,
    DEFAULT_FIRST_CONTEXT_BUCKET,
    CaptureSizes,
    ContextBuckets,
    GraphKey,
    StepReach,
    blocks_needed,
)
from runners.captured import CapturedGraph, capture_step, static_memory
from runners.engine.executor import EngineLimits, ScheduledChunk
from runners.errors import CaptureSizeError, RunnerInputError
from runners.layout import CacheLayout
from runners.modes import CUDAGraphMode

__all__ = ["ModelRunner"]

CaptureCallback = Callable[[GraphKey, float], None]
DEFAULT_MAX_GRAPH_CONTEXTS = 4


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
        eager_region: EagerRegionStrategy,
        decode_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        mixed_mode: CUDAGraphMode = CUDAGraphMode.PIECEWISE,
        capture_sizes: Iterable[int] = DEFAULT_CAPTURE_SIZES,
        max_num_tokens: int = 256,
        audit: AuditMode = "raise",
        first_context_bucket: int = DEFAULT_FIRST_CONTEXT_BUCKET,
        max_graph_contexts: int = DEFAULT_MAX_GRAPH_CONTEXTS,
        collectives_in_graph: bool = True,
    ) -> None:
        """``eager_region``: the strategy every attention layer composes its region with under
        this runner (``build_runner`` passes the resolved one). ``audit``: ``"raise"`` at an
        unstable captured read, ``"report"`` it, or ``"off"``. ``first_context_bucket``: tokens
        the smallest context bucket covers; ``max_graph_contexts``: how many context buckets
        graphs are held for; ``collectives_in_graph``: whether a tensor-parallel model's
        collectives are captured with the graphs or run as eager breaks (the resolution's
        ``collectives_in_graph``, handed to the model in every step's forward context)."""
        for kind, mode in (("decode", decode_mode), ("mixed", mixed_mode)):
            if not mode.is_basic:
                raise ValueError(f"the {kind} mode must be NONE, PIECEWISE or FULL, not {mode}")
        if mixed_mode is CUDAGraphMode.FULL:
            raise ValueError("FULL graphs serve uniform-decode batches only; use PIECEWISE")
        if max_graph_contexts < 1:
            raise CaptureSizeError(
                f"max_graph_contexts must be at least 1, got {max_graph_contexts}"
            )
        platform.require_available()
        self.platform = platform
        self.device = platform.device
        self.model = model
        self._panel_copies = PanelCopies(model)
        self.layout = layout
        self.eager_region = eager_region
        self.decode_mode = decode_mode
        self.mixed_mode = mixed_mode
        self.max_num_tokens = max_num_tokens
        self.capture_sizes = CaptureSizes.of(capture_sizes, max_num_tokens=max_num_tokens)
        carried = layout.max_rows * layout.max_context  # every request in flight, at its longest
        if max(self.capture_sizes.sizes) > carried:
            raise CaptureSizeError(
                f"capture size {max(self.capture_sizes.sizes)} exceeds what one step can carry: "
                f"{layout.max_rows} requests of at most {layout.max_context} tokens hold "
                f"{carried}; drop the size or raise max_num_seqs or max_model_len"
            )
        self.context_buckets = ContextBuckets.of(
            max_blocks=layout.max_blocks_per_row,
            block_size=layout.block_size,
            first_tokens=first_context_bucket,
        )
        self.max_graph_contexts = max_graph_contexts
        self.collectives_in_graph = collectives_in_graph
        self.audit: AuditMode = audit
        self.vocab_size: int = model.config.vocab_size
        self.entry_rate = entry_rate(model.config)
        self.limits = EngineLimits(
            max_rows=layout.max_rows,
            max_num_tokens=max_num_tokens,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            max_blocks_per_row=layout.max_blocks_per_row,
            vocab_size=self.vocab_size,
            num_entry_blocks=layout.num_entry_blocks,
            entry_rate=self.entry_rate,
            lookback=lookback(model.config),
            max_model_len=layout.max_model_len,
            prefix_boundary=prefix_boundary(model.config, layout.block_size),
        )
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.kv_caches = allocate_kv_caches(
            model.config,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            num_entry_blocks=layout.num_entry_blocks,
            device=self.device,
            dtype=model.compute_dtype,
        )
        self.static_memory = static_memory(
            model,
            inputs={"input_ids": self.input_ids, "positions": self.positions},
            kv_caches=self.kv_caches.tensors(),
            metadata=self._static_metadata(),
        )
        self._backend = platform.graph_backend()
        self._graphs: dict[GraphKey, CapturedGraph] = {}

    # -- subclass hooks --------------------------------------------------------------------------
    @abc.abstractmethod
    def _write_metadata(
        self, chunks: Sequence[ScheduledChunk], num_tokens: int, width: int
    ) -> AttentionMetadata:
        """Metadata for ``chunks`` padded to ``num_tokens``, its block table ``width`` blocks
        wide; also fills ``positions[:T]``."""

    @abc.abstractmethod
    def _static_metadata(self) -> dict[str, torch.Tensor]:
        """Metadata memory at fixed addresses across steps, by name (none for V1)."""

    # -- public API ------------------------------------------------------------------------------
    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Run one step; return ``[len(chunks), vocab]`` fp32 logits of each chunk's last token."""
        num_tokens = self._validate(chunks, token_ids)
        uniform = all(chunk.num_tokens == 1 for chunk in chunks)
        mode = self.decode_mode if uniform else self.mixed_mode
        padded = self.capture_sizes.padded(num_tokens)
        width = blocks_needed(chunks, self.layout.block_size)
        graph = None
        if mode is not CUDAGraphMode.NONE and padded is not None:
            graph = self._graph(GraphKey(mode, padded, self.context_buckets.bucket(width)))
        if graph is None:
            padded = num_tokens
        else:
            padded, width = graph.key.num_tokens, graph.key.width
        flat = [t for ids in token_ids for t in ids]
        stage_into(self.input_ids[:num_tokens], torch.tensor(flat, dtype=torch.int64))
        self.input_ids[num_tokens:padded].zero_()
        ctx = self._context(self._write_metadata(chunks, padded, width))
        ends = torch.empty(len(chunks), dtype=torch.int64, device=self.device)
        stage_into(ends, torch.tensor(_last_token_indices(chunks), dtype=torch.int64))
        with forward_context(ctx), torch.inference_mode(), device_work():
            # weights written in place since the last step reach the copies graphs read, as a
            # CUDA graph reads its parameters' memory
            self._panel_copies.refresh()
            if graph is None:
                logits = self.model(self.input_ids[:padded], self.positions[:padded])
            else:
                graph.capture.replay()
                logits = graph.logits
            return logits.index_select(0, ends)

    def capture(
        self, on_captured: CaptureCallback | None = None, *, reach: StepReach | None = None
    ) -> None:
        """Capture every (mode, size) this runner can dispatch to, for the smallest
        ``max_graph_contexts`` context buckets not yet refused by the cap; largest bucket first,
        and within one, largest size first. With ``reach`` (the requests are known), only the
        graphs their steps can replay: the sizes their batches pad to, the buckets up to the
        one their furthest position needs. A step beyond it would still capture lazily.

        ``on_captured(key, seconds)`` is called after each graph this call captures (progress
        output and per-size capture timing); graphs captured earlier are skipped.
        """
        modes = [m for m in (self.decode_mode, self.mixed_mode) if m is not CUDAGraphMode.NONE]
        if not modes:
            return
        held = self._held_widths()
        widths = [w for w in self.context_buckets.widths if w in held]
        for width in self.context_buckets.widths:
            if len(widths) < self.max_graph_contexts and width not in widths:
                widths.append(width)
        if reach is not None:
            need = min(-(-reach.positions // self.layout.block_size), self.context_buckets.largest)
            widths = [w for w in widths if w <= self.context_buckets.bucket(need)]
        for width in sorted(widths, reverse=True):
            for size in self.capture_sizes.largest_first():
                for mode in dict.fromkeys(modes):
                    key = GraphKey(mode, size, width)
                    if key in self._graphs or size not in self._sizes(mode, reach):
                        continue
                    start = time.perf_counter()
                    self._graph(key, reach)
                    if on_captured is not None:
                        on_captured(key, time.perf_counter() - start)

    def clear_graphs(self) -> None:
        """Drop every captured graph; later steps capture again, into a fresh pool."""
        self._graphs.clear()
        self._backend = self.platform.graph_backend()

    @property
    def graph_backend(self) -> GraphBackend:
        """The backend (and so the memory pool) the runner's graphs are recorded with."""
        return self._backend

    @property
    def captured(self) -> tuple[GraphKey, ...]:
        """The (mode, padded size, width) keys captured so far, in capture order."""
        return tuple(self._graphs)

    @property
    def num_graphs(self) -> int:
        return sum(g.capture.num_graphs for g in self._graphs.values())

    @property
    def num_eager_breaks(self) -> int:
        return sum(g.capture.num_eager_breaks for g in self._graphs.values())

    @property
    def audit_findings(self) -> tuple[AuditFinding, ...]:
        """Every finding of the captures so far (collected when ``audit == "report"``)."""
        return tuple(f for g in self._graphs.values() for f in g.audit)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(platform={self.platform.name}, decode={self.decode_mode.name}, "
            f"mixed={self.mixed_mode.name}, region={self.eager_region}, "
            f"sizes={self.capture_sizes.sizes}, captured={len(self._graphs)})"
        )

    # -- internals -------------------------------------------------------------------------------
    def _context(self, metadata: AttentionMetadata) -> ForwardContext:
        """The forward context of one step (or capture) with ``metadata``."""
        return ForwardContext(
            attn_metadata=metadata,
            kv_caches=self.kv_caches,
            eager_region=self.eager_region,
            collectives_in_graph=self.collectives_in_graph,
        )

    def _held_widths(self) -> set[int]:
        return {key.width for key in self._graphs}

    def _graph(self, key: GraphKey, reach: StepReach | None = None) -> CapturedGraph | None:
        """The graph for ``key``; captured now if missing, after every missing larger size of
        its mode and bucket (within ``reach``, if given; largest first, so smaller graphs reuse
        their pool memory). ``None`` when ``key``'s bucket holds no graphs and
        ``max_graph_contexts`` buckets already do."""
        if key not in self._graphs:
            held = self._held_widths()
            if key.width not in held and len(held) >= self.max_graph_contexts:
                return None
            with collector_paused():  # recording makes objects by the ten thousand
                for larger in reversed(self._sizes(key.mode, reach)):
                    bigger = key._replace(num_tokens=larger)
                    if larger >= key.num_tokens and bigger not in self._graphs:
                        self._graphs[bigger] = self._capture(bigger)
        return self._graphs[key]

    def _sizes(self, mode: CUDAGraphMode, reach: StepReach | None = None) -> tuple[int, ...]:
        """The sizes graphs of ``mode`` are captured for, those a batch it serves can pad to:
        FULL serves uniform-decode batches, at most one token per block-table row; a mode that
        serves mixed batches only (the decode mode differs) never sees one token (a mixed batch
        has a chunk of two or more), so it skips size 1. ``reach`` bounds both further: a
        decode batch by its ``decode_batch``, any step by its ``step_tokens``."""
        decode_only = mode is not self.mixed_mode
        limit = self.layout.max_rows if mode is CUDAGraphMode.FULL else self.max_num_tokens
        if reach is not None:
            limit = min(limit, reach.decode_batch if decode_only else reach.step_tokens)
        sizes = self.capture_sizes.serving(limit)
        if mode is not self.decode_mode:
            return tuple(size for size in sizes if size > 1)
        return sizes

    def _capture(self, key: GraphKey) -> CapturedGraph:
        graphs = getattr(self._backend.pool, "graphs", None)
        if isinstance(graphs, PoolGraphs) and graphs.retired:
            self._backend = self.platform.graph_backend()
        size = key.num_tokens
        try:
            with device_work():
                return capture_step(
                    self.model,
                    key=key,
                    input_ids=self.input_ids[:size],
                    positions=self.positions[:size],
                    dummy_context=lambda: self._context(self._write_metadata((), size, key.width)),
                    backend=self._backend,
                    static=self.static_memory,
                    audit=self.audit,
                )
        except BaseException:
            # whatever failed, the backend's stream and pool may be left in any state (on CUDA
            # an invalidated capture, blocks it allocated): the next capture takes fresh ones
            self._backend = self.platform.graph_backend()
            raise

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
            where = f"row {chunk.row}"
            if len(ids) != chunk.num_tokens:
                raise RunnerInputError(f"{where}: {len(ids)} token ids for {chunk.num_tokens}")
            if not 0 <= chunk.row < self.layout.max_rows:
                raise RunnerInputError(f"{where} is outside 0..{self.layout.max_rows - 1}")
            for what, blocks, pool in (
                ("block", chunk.block_ids, self.layout.num_blocks),
                ("entry block", chunk.entry_block_ids, self.layout.num_entry_blocks),
            ):
                bad = [b for b in blocks if not 0 <= b < pool]
                if bad:
                    raise RunnerInputError(
                        f"{where}: {len(bad)} {what} ids outside 0..{pool - 1} (first: {bad[0]})"
                    )
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise RunnerInputError(f"{where}: token ids outside 0..{self.vocab_size - 1}")
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
