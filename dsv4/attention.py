"""``DeepseekV4Attention``: one attention layer, composed with an eager-region strategy.

``forward(positions, hidden_states)`` runs, in order:
1. input projections (always captured): ``q_res = q_a_norm(q_a_proj(x))``, ``kv_proj(x)``, and
   the preallocation of the ``[T, heads, head_dim]`` output the attention core writes into;
2. the region — what the forward context's ``eager_region`` composed from the two private
   steps (composed once per strategy and layer, then reused):
   - ``_prepare``: everything that reads or writes attention metadata: query up-projection,
     per-head norm and RoPE; KV norm, RoPE and cache insert; the compressor; the indexer's
     keys, queries and weights; and every cache address ``_attend`` will read (the window's
     key slots, the compressed entries' slots and visibility). No host syncs, shapes static
     in T (capturable);
   - ``_attend``: indexer scoring and top-k, then one softmax per head over the window keys,
     the visible (CSA: selected) compressed entries and the sink; writes the preallocated
     output and returns it. No host syncs on any path: each token gathers its own request's
     window and entries with static shapes and masks what it may not see (the keys of
     entries it may not see are zeroed too, so no stale row can reach it), so even FULL
     graphs can capture it;
3. inverse RoPE on the output and the grouped low-rank output projection (captured), then,
   with tensor parallelism, the all-reduce of the partial outputs (``TensorParallel``).

Tensor parallelism (``parallel``): a rank holds ``num_attention_heads / N`` query heads — their
rows of ``q_b_proj`` and their ``sinks`` — and the ``o_groups / N`` output groups those heads
feed (rows of ``o_a_proj``; the matching columns of ``o_b_proj``, a row-parallel projection whose
partial sums one all-reduce adds). Replicated, with the reasons: ``q_a_proj``/``q_a_norm`` (the
low-rank query every head and the indexer read); the single shared KV head ``kv_proj``/``kv_norm``
(every head attends to it, so each rank writes the same full KV cache and needs no collective
before attending); the compressor and the indexer (their entries are keys of that one KV head,
and the indexer's top-k must pick the same entries on every rank; splitting its heads would put
an all-reduce of its scores inside the attention region, for a small module).

No other path calls ``_prepare``/``_attend``, so no caller can bypass the strategy.
``_prepare`` reads the step's metadata and the layer's paged caches from the forward context;
``_attend`` reads nothing of the context, only what ``_prepare`` handed it: an eager segment
replays with its capture-time arguments, and those are tensors the captured ``_prepare``
rewrites on every replay (or, in a wider region, fresh tensors of the same eager run). The layer
holds no per-run state: the region, the metadata and the caches all arrive with the step, so
several runners may drive one model in turn.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import attrs
import torch
from torch import nn

from dsv4.cache import LayerCache, PagedKVCaches, entry_stride
from dsv4.compressor import Compressor
from dsv4.config import CSA, SLIDING, DeepseekV4Config
from dsv4.indexer import Indexer
from dsv4.layers import (
    NARROW_DTYPES,
    GroupedLinear,
    Linear,
    RMSNorm,
    as_dtype,
    read_rows,
    rms_normalize,
)
from dsv4.metadata import AttentionMetadata
from dsv4.native_ops import ATTEND_INTO, native_takes
from dsv4.paging import EntryPages, Window, request_blocks, sink_rows, write_rows
from dsv4.parallel import SINGLE, TensorParallel
from dsv4.pooling import PoolingPlan, entry_capacity, entry_ends
from dsv4.rope import RotaryEmbedding, RotaryTables
from graphs import EagerRegionStrategy, ForwardContext, get_forward_context

__all__ = ["ATTEND_CHUNK", "DeepseekV4Attention", "attend_takes"]

ATTEND_CHUNK = 32
"""Queries attended at once. Each query gathers its request's window keys and every compressed
entry (``T x capacity x dim`` per layer), so a long prefill step would otherwise materialise
that for all its tokens at once; a slice of queries bounds it without changing what any query
computes (every query's attention is its own)."""


@attrs.frozen(kw_only=True, eq=False)
class _Entries:
    """The compressed entries every query may attend (one row per token)."""

    slots: torch.Tensor
    """``[T, capacity]`` entry rows of every entry of the token's request."""
    visible: torch.Tensor
    """``[T, capacity]`` which of them are complete for the token."""
    index_queries: torch.Tensor | None
    index_weights: torch.Tensor | None


@attrs.frozen(kw_only=True, eq=False)
class _Prepared:
    """What ``_prepare`` hands to ``_attend``: the layer's caches and tensors (every address
    already resolved)."""

    cache: LayerCache
    queries: torch.Tensor
    window: Window
    """The sliding window: key slots and positions (negative: before the request's start)."""
    entries: _Entries | None
    out: torch.Tensor


def _identity(t: torch.Tensor) -> tuple[object, ...]:
    """A step-unique name of ``t``'s values, for ``ForwardContext.once`` keys: its address,
    shape and strides (every layer is handed the same positions)."""
    return (t.data_ptr(), tuple(t.shape), t.stride())


def _metadata(ctx: ForwardContext) -> AttentionMetadata:
    metadata = ctx.attn_metadata
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"the forward context carries {type(metadata).__name__}, expected AttentionMetadata"
        )
    return metadata


def _layer_cache(ctx: ForwardContext, layer_idx: int, num_layers: int) -> LayerCache:
    caches = ctx.kv_caches
    if not isinstance(caches, PagedKVCaches):
        raise RuntimeError(
            "the forward context carries no KV caches: pass ForwardContext(kv_caches=...) the "
            "caches allocate_kv_caches made for this model"
        )
    if len(caches.layers) != num_layers:
        raise ValueError(f"caches hold {len(caches.layers)} layers, the model has {num_layers}")
    return caches.layers[layer_idx]


class DeepseekV4Attention(nn.Module):
    """Shared-KV multi-query attention with window, compressed entries, sinks and grouped output."""

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, parallel: TensorParallel = SINGLE
    ) -> None:
        """The layer's share for rank ``parallel`` (see the module docstring); ``parallel.size``
        must divide the heads and the output groups."""
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel = parallel
        self.num_layers = config.num_hidden_layers
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = len(parallel.share(config.num_attention_heads))
        self.head_dim = config.head_dim
        self.o_groups = len(parallel.share(config.o_groups))
        self.sliding_window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.scaling = config.head_dim**-0.5
        hidden, heads_dim = config.hidden_size, self.num_heads * config.head_dim
        self.q_a_proj = Linear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, heads_dim)
        self.kv_proj = Linear(hidden, config.head_dim)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            heads_dim // self.o_groups, self.o_groups * config.o_lora_rank, self.o_groups
        )
        self.o_b_proj = Linear(self.o_groups * config.o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        if self.layer_type == SLIDING:
            self.rope = RotaryEmbedding(
                config.rope_dim, config.rope_theta, config.main_yarn, (config.head_dim,)
            )
            self.compressor: Compressor | None = None
        else:
            widths = (
                (config.head_dim,)
                if self.layer_type != CSA
                else (config.head_dim, config.index_head_dim)
            )
            self.rope = RotaryEmbedding(
                config.rope_dim, config.compress_rope_theta, config.compress_yarn, widths
            )
            self.compressor = _compressor(config, self.layer_type)
        self.entry_stride = entry_stride(config, self.layer_type) if self.compressor else 1
        """Finest-rate entries per entry of this layer (``dsv4.paging.EntryPages``)."""
        self._regions: dict[EagerRegionStrategy, Callable[..., torch.Tensor]] = {}
        """The region each strategy composed, by strategy (composed on first use)."""

    def _region(self, strategy: EagerRegionStrategy) -> Callable[..., torch.Tensor]:
        """What ``strategy`` composes from ``_prepare`` and ``_attend`` (composed once)."""
        composed = self._regions.get(strategy)
        if composed is None:
            composed = self._regions[strategy] = strategy.compose(self._prepare, self._attend)
        return composed

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` at ``positions``; the metadata, caches and region
        come from the forward context."""
        ctx = get_forward_context()
        region = self._region(ctx.eager_region)
        tokens = hidden_states.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        kv = self.kv_proj(hidden_states)
        out = hidden_states.new_empty(tokens, self.num_heads, self.head_dim)
        query_positions = positions.unsqueeze(-1)
        dtype = hidden_states.dtype
        tables = ctx.once(
            ("query rope rows", self.rope.signature, dtype, _identity(positions)),
            lambda: self.rope.tables(query_positions, dtype),
        )
        heads = tables.per_head()
        attended = region(
            positions, query_positions, hidden_states, q_residual, kv, out, tables, heads
        )
        attended = self.rope.rotate(attended, heads.last(self.head_dim), inverse=True)
        grouped = self.o_a_proj(attended.reshape(tokens, self.o_groups, -1)).flatten(1)
        return self.parallel.all_reduce_(self.o_b_proj(grouped))

    def _prepare(
        self,
        positions: torch.Tensor,
        query_positions: torch.Tensor,
        hidden_states: torch.Tensor,
        q_residual: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        tables: RotaryTables,
        heads: RotaryTables,
    ) -> _Prepared:
        ctx = get_forward_context()
        metadata, cache = _metadata(ctx), _layer_cache(ctx, self.layer_idx, self.num_layers)
        q = self.q_b_proj(q_residual).unflatten(-1, (self.num_heads, self.head_dim))
        q = self.rope.rotate(rms_normalize(q, self.eps), heads.last(self.head_dim))
        # every cache of the model has the same rows, so every layer writes the same rows
        write = ctx.once(
            ("cache rows written", cache.kv.shape[0]),
            lambda: sink_rows(metadata.slot_mapping, cache.kv),
        )
        write_rows(cache.kv, write, self.rope.rotate(self.kv_norm(kv), tables.last(self.head_dim)))
        block_size = metadata.block_size
        at = _identity(query_positions)
        compressor = self.compressor
        span = compressor.span if compressor is not None else 0
        # one window serves attention and pooling: its trailing sliding_window / span positions
        length = max(self.sliding_window, span)
        window = ctx.once(
            ("window", length, at),
            lambda: Window.ending_at(
                query_positions,
                length,
                ctx.once(("request blocks",), lambda: request_blocks(metadata)),
                block_size,
            ),
        )
        prepared = _Prepared(
            cache=cache, queries=q, window=window.last(self.sliding_window), entries=None, out=out
        )
        if compressor is None or cache.compressor is None:
            return prepared
        rate, stride, overlap = compressor.rate, self.entry_stride, compressor.overlap
        entry_pages = ctx.once(("entry pages", stride), lambda: EntryPages.of(metadata, stride))
        entry_sink = cache.compressor.entries.shape[0] - 1
        plan = ctx.once(
            ("pooling plan", rate, stride, length, span, overlap, entry_sink, at),
            lambda: PoolingPlan.build(
                positions,
                rate,
                window.last(span),
                metadata.slot_mapping >= 0,
                entry_pages,
                entry_sink,
                overlap=overlap,
            ),
        )
        entry_tables = ctx.once(
            (
                "entry rope rows",
                self.rope.signature,
                hidden_states.dtype,
                _identity(plan.entry_positions),
            ),
            lambda: self.rope.tables(plan.entry_positions.unsqueeze(-1), hidden_states.dtype),
        )
        compressor.update(hidden_states, write, plan, cache.compressor, self.rope, entry_tables)
        index_queries = index_weights = None
        indexer = compressor.indexer
        if indexer is not None and cache.indexer is not None:
            # same rate and overlap as the compressor: the same windows and entries
            indexer.update(hidden_states, write, plan, cache.indexer, self.rope, entry_tables)
            index_queries, index_weights = indexer.queries(
                hidden_states, q_residual, heads, self.rope
            )
        capacity = entry_capacity(metadata, rate)
        if capacity == 0:
            return prepared
        slots, visible = ctx.once(
            ("entries", rate, stride, capacity, at),
            lambda: (
                entry_pages.rows(torch.arange(capacity, device=positions.device)),
                entry_ends(capacity, rate, positions.device) <= query_positions,
            ),
        )
        entries = _Entries(
            slots=slots, visible=visible, index_queries=index_queries, index_weights=index_weights
        )
        return attrs.evolve(prepared, entries=entries)

    def _attend(self, prepared: _Prepared) -> torch.Tensor:
        """Attend every query, ``ATTEND_CHUNK`` queries at a time, into ``prepared.out`` (a
        step of at most ``ATTEND_CHUNK`` tokens, every decode step, slices nothing)."""
        tokens = prepared.queries.shape[0]
        if tokens <= ATTEND_CHUNK:
            self._attend_queries(prepared, lambda tensor: tensor)
            return prepared.out
        for start in range(0, tokens, ATTEND_CHUNK):
            rows = slice(start, min(start + ATTEND_CHUNK, tokens))
            self._attend_queries(prepared, operator.itemgetter(rows))
        return prepared.out

    def _attend_queries(
        self, prepared: _Prepared, rows: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Attend the queries ``rows`` picks (a static slice of the step's tokens, or all of
        them) into their rows of ``prepared.out``: each gathers its request's window keys and
        compressed entries."""
        cache, window = prepared.cache, prepared.window
        key_rows, visible = rows(window.slots), rows(window.positions) >= 0
        entries = prepared.entries
        entry_table = entry_rows = entry_visible = None
        if entries is not None and cache.compressor is not None:
            entry_rows, entry_visible = rows(entries.slots), rows(entries.visible)
            indexer = self.compressor.indexer if self.compressor is not None else None
            if indexer is not None and cache.indexer is not None:
                assert entries.index_queries is not None and entries.index_weights is not None
                chosen = indexer.select(
                    rows(entries.index_queries),
                    rows(entries.index_weights),
                    read_rows(cache.indexer.entries, entry_rows),
                    entry_visible,
                )
                entry_rows = entry_rows.gather(1, chosen)
                entry_visible = entry_visible.gather(1, chosen)
            entry_table = cache.compressor.entries
        queries, out = rows(prepared.queries), rows(prepared.out)
        # a window narrower than the one computed is a column slice: copied, so whether the
        # native op runs never depends on how many queries a slice holds
        parts = (cache.kv, key_rows.contiguous(), visible, entry_table, entry_rows, entry_visible)
        if attend_takes(out, queries, self.sinks, *parts):
            ATTEND_INTO(out, queries, *parts, self.sinks, self.scaling)
            return
        widened = _widened(queries, parts)
        if widened is not None and attend_takes(widened[0], widened[0], self.sinks, *widened[1]):
            wide_out = torch.empty_like(widened[0])
            ATTEND_INTO(wide_out, widened[0], *widened[1], self.sinks, self.scaling, queries.dtype)
            out.copy_(wide_out)
            return
        keys = read_rows(cache.kv, key_rows)
        if entry_table is not None and entry_rows is not None and entry_visible is not None:
            # an entry a query cannot see weighs nothing, but its row may hold anything (a
            # block's unwritten rows, or NaN left by a request that failed): 0 * NaN is NaN
            entry_keys = read_rows(entry_table, entry_rows)
            entry_keys = torch.where(entry_visible.unsqueeze(-1), entry_keys, 0.0)
            keys = torch.cat((keys, entry_keys), dim=1)
            visible = torch.cat((visible, entry_visible), dim=1)
        logits = torch.einsum("thd,tkd->thk", queries, keys) * self.scaling
        logits = torch.where(visible.unsqueeze(1), logits, float("-inf"))
        sinks = self.sinks.view(1, -1, 1).expand(queries.shape[0], -1, 1)
        logits = torch.cat((as_dtype(logits, torch.float32), sinks), dim=-1)
        probs = as_dtype(logits.softmax(dim=-1)[..., :-1], keys.dtype)
        torch.bmm(probs, keys, out=out)


_Parts = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]
"""The attention core's key arguments: the window's table, rows and seen, the entries' ones."""


def _widened(queries: torch.Tensor, parts: _Parts) -> tuple[torch.Tensor, _Parts] | None:
    """The native attention's arguments for narrow (``NARROW_DTYPES``) queries and tables, on
    one CPU thread: the queries and each token's keys and entries (gathered, an unseen one
    zeroed) widened to float32, exactly, with rows that read them in order. The kernel then
    computes in its fixed order, rounding to the narrow dtype where the composite below rounds
    (each logit before and after scaling, each weight), so it gives the same bits on every
    instruction set, where ATen's narrow products and softmax do not; the caller rounds its
    output once. Else ``None``."""
    keys, key_rows, key_seen, entries, entry_rows, entry_seen = parts
    narrow = queries.dtype in NARROW_DTYPES and keys.dtype == queries.dtype
    if not (narrow and queries.device.type == "cpu" and torch.get_num_threads() == 1):
        return None
    if not native_takes():
        return None
    wide_keys, wide_key_rows = _gathered_in_order(keys, key_rows, key_seen)
    if entries is None or entry_rows is None or entry_seen is None:
        return queries.float(), (wide_keys, wide_key_rows, key_seen, None, None, None)
    wide_entries, wide_entry_rows = _gathered_in_order(entries, entry_rows, entry_seen)
    return queries.float(), (
        wide_keys,
        wide_key_rows,
        key_seen,
        wide_entries,
        wide_entry_rows,
        entry_seen,
    )


def _gathered_in_order(
    table: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``table``'s ``rows`` (an unseen one zeroed) as a float32 table, and the rows reading it
    in order."""
    gathered = torch.where(seen.unsqueeze(-1), read_rows(table, rows), 0.0)
    order = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    return gathered.view(-1, table.shape[-1]).float(), order


def attend_takes(
    out: torch.Tensor,
    queries: torch.Tensor,
    sinks: torch.Tensor,
    keys: torch.Tensor,
    key_rows: torch.Tensor,
    key_seen: torch.Tensor,
    entries: torch.Tensor | None,
    entry_rows: torch.Tensor | None,
    entry_seen: torch.Tensor | None,
) -> bool:
    """Whether the attention core runs as one native operator (``dsv4::attend_into``: the keys
    read in place from their tables, logits, mask, sink, softmax and weighted sum in one
    kernel, a key the token may not see left out): float32 tables and queries on one CPU
    thread, contiguous int64 rows and boolean masks."""
    indices = [t for t in (key_rows, entry_rows) if t is not None]
    masks = [t for t in (key_seen, entry_seen) if t is not None]
    return (
        torch.get_num_threads() == 1
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in indices)
        and all(t.dtype == torch.bool and t.is_contiguous() for t in masks)
        and native_takes(out, queries, keys, entries, sinks)
    )


def _compressor(config: DeepseekV4Config, layer_type: str) -> Compressor:
    rate = config.compress_rate(layer_type)
    csa = layer_type == CSA
    indexer = (
        Indexer(
            config.hidden_size,
            config.q_lora_rank,
            num_heads=config.index_n_heads,
            head_dim=config.index_head_dim,
            rate=rate,
            topk=config.index_topk,
            eps=config.rms_norm_eps,
        )
        if csa
        else None
    )
    return Compressor(
        config.hidden_size,
        config.head_dim,
        rate,
        overlap=csa,
        eps=config.rms_norm_eps,
        indexer=indexer,
    )
