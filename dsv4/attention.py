"""``DeepseekV4Attention``: one attention layer, composed with an eager-region strategy.

``forward(positions, hidden_states)`` runs, in order:
1. input projections (always captured): ``q_res = q_a_norm(q_a_proj(x))``, ``kv_proj(x)``, and
   the preallocation of the ``[T, heads, head_dim]`` output the attention core writes into;
2. ``self._region(...)`` — what the strategy composed from the two private steps:
   - ``_prepare``: everything that reads or writes attention metadata: query up-projection,
     per-head norm and RoPE; KV norm, RoPE and cache insert; the compressor; the indexer's
     keys, queries and weights. No host syncs, shapes static in T (capturable);
   - ``_attend``: indexer scoring and top-k, then one softmax per head over the window keys,
     the visible (CSA: selected) compressed entries and the sink; writes the preallocated
     output and returns it. No host syncs on any path: each token gathers its own request's
     window and entries through the block table with static shapes and masks what it may not
     see, so even FULL graphs can capture it;
3. inverse RoPE on the output and the grouped low-rank output projection (captured).

No other path calls ``_prepare``/``_attend``, so no caller can bypass the strategy.
``_attend`` reads the metadata from the forward context itself, never from its argument: an
eager segment replays with its capture-time arguments, but must see the step being replayed.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from dsv4.cache import LayerCache
from dsv4.compressor import Compressor
from dsv4.config import CSA, SLIDING, DeepseekV4Config
from dsv4.indexer import Indexer
from dsv4.layers import GroupedLinear, RMSNorm, as_dtype, rms_normalize
from dsv4.metadata import AttentionMetadata
from dsv4.paging import sink_rows, token_slots, write_rows
from dsv4.pooling import PoolingPlan, entry_capacity, entry_visible
from dsv4.rope import RotaryEmbedding, RotaryTables
from graphs import EagerRegionStrategy, NarrowRegion, get_forward_context

__all__ = ["DeepseekV4Attention"]


@attrs.frozen(kw_only=True, eq=False)
class _Prepared:
    """What ``_prepare`` hands to ``_attend``: tensors only, no metadata."""

    queries: torch.Tensor
    positions: torch.Tensor
    index_queries: torch.Tensor | None
    index_weights: torch.Tensor | None
    out: torch.Tensor


def _metadata() -> AttentionMetadata:
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"the forward context carries {type(metadata).__name__}, expected AttentionMetadata"
        )
    return metadata


class DeepseekV4Attention(nn.Module):
    """Shared-KV multi-query attention with window, compressed entries, sinks and grouped output."""

    def __init__(
        self,
        config: DeepseekV4Config,
        layer_idx: int,
        *,
        strategy: EagerRegionStrategy = NarrowRegion(),  # noqa: B008 - strategies are values
    ) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.o_groups = config.o_groups
        self.sliding_window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.scaling = config.head_dim**-0.5
        hidden, heads_dim = config.hidden_size, config.num_attention_heads * config.head_dim
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, config.head_dim, bias=False)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            heads_dim // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups
        )
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))
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
        self._cache: LayerCache | None = None
        self.use_strategy(strategy)

    # -- configuration -------------------------------------------------------------------------
    @property
    def strategy(self) -> EagerRegionStrategy:
        return self._strategy

    def use_strategy(self, strategy: EagerRegionStrategy) -> None:
        """Re-compose the region from ``strategy`` (the model's ``set_eager_region`` calls this)."""
        self._strategy = strategy
        self._region = strategy.compose(self._prepare, self._attend)

    def bind_cache(self, cache: LayerCache) -> None:
        """Attach this layer's paged caches (owned by the runner)."""
        self._cache = cache

    # -- forward -------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` at ``positions`` (metadata: forward context)."""
        tokens = hidden_states.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        kv = self.kv_proj(hidden_states)
        out = hidden_states.new_empty(tokens, self.num_heads, self.head_dim)
        tables = self.rope.tables(positions, hidden_states.dtype, self.head_dim)
        attended = self._region(positions, hidden_states, q_residual, kv, out, tables)
        attended = self.rope.rotate(attended, tables, inverse=True)
        grouped = self.o_a_proj(attended.reshape(tokens, self.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    def _cache_or_raise(self) -> LayerCache:
        if self._cache is None:
            raise RuntimeError("no KV caches bound: call model.bind_kv_caches(caches) first")
        return self._cache

    def _prepare(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        q_residual: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        tables: RotaryTables,
    ) -> _Prepared:
        metadata, cache = _metadata(), self._cache_or_raise()
        q = self.q_b_proj(q_residual).unflatten(-1, (self.num_heads, self.head_dim))
        q = self.rope.rotate(rms_normalize(q, self.eps), tables)
        write = sink_rows(metadata.slot_mapping, cache.kv)
        write_rows(cache.kv, write, self.rope.rotate(self.kv_norm(kv), tables))
        index_queries = index_weights = None
        compressor = self.compressor
        if compressor is not None and cache.compressor is not None:
            plan = PoolingPlan.build(
                positions, metadata, compressor.rate, compressor.span, cache.kv
            )
            compressor.update(hidden_states, write, plan, cache.compressor, self.rope)
            indexer = compressor.indexer
            if indexer is not None and cache.indexer is not None:
                # same rate and overlap as the compressor: the same windows and entries
                indexer.update(hidden_states, write, plan, cache.indexer, self.rope)
                index_queries, index_weights = indexer.queries(
                    hidden_states, q_residual, positions, self.rope
                )
        return _Prepared(
            queries=q,
            positions=positions,
            index_queries=index_queries,
            index_weights=index_weights,
            out=out,
        )

    def _attend(self, prepared: _Prepared) -> torch.Tensor:
        metadata, cache = _metadata(), self._cache_or_raise()
        positions, rows = prepared.positions, metadata.token_request.unsqueeze(-1)
        offsets = torch.arange(1 - self.sliding_window, 1, device=positions.device)
        window = positions.unsqueeze(-1) + offsets
        keys = cache.kv[token_slots(metadata, rows, window.clamp(min=0))]
        visible = window >= 0
        compressor = self.compressor
        if compressor is not None and cache.compressor is not None:
            capacity = entry_capacity(metadata, compressor.rate)
            if capacity > 0:
                entries = torch.arange(capacity, device=positions.device)
                slots = token_slots(metadata, rows, entries)
                entries_visible = entry_visible(entries, positions, compressor.rate)
                indexer = compressor.indexer
                if indexer is not None and cache.indexer is not None:
                    assert prepared.index_queries is not None
                    assert prepared.index_weights is not None
                    chosen = indexer.select(
                        prepared.index_queries,
                        prepared.index_weights,
                        cache.indexer.entries[slots],
                        entries_visible,
                    )
                    slots = slots.gather(1, chosen)
                    entries_visible = entries_visible.gather(1, chosen)
                keys = torch.cat((keys, cache.compressor.entries[slots]), dim=1)
                visible = torch.cat((visible, entries_visible), dim=1)
        queries = prepared.queries
        logits = torch.einsum("thd,tkd->thk", queries, keys) * self.scaling
        logits = torch.where(visible.unsqueeze(1), logits, float("-inf"))
        sinks = self.sinks.view(1, -1, 1).expand(queries.shape[0], -1, 1)
        logits = torch.cat((as_dtype(logits, torch.float32), sinks), dim=-1)
        probs = as_dtype(logits.softmax(dim=-1)[..., :-1], keys.dtype)
        prepared.out.copy_(torch.einsum("thk,tkd->thd", probs, keys))
        return prepared.out


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
