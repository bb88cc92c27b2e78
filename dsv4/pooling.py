"""Window pooling of the KV compressors and the indexer: each complete window of ``m`` tokens
becomes one compressed entry.

Entry ``w`` covers positions ``w*m .. w*m+m-1`` and becomes visible to the query at position
``t`` once that window is complete: ``(w+1)*m - 1 <= t``.

- Heavily compressed (HCA, no overlap): entry = kv_norm(sum over the window's ``m`` tokens of
  softmax-over-slots(gate + position_bias[slot]) * kv), RoPE at position ``w*m``.
- Overlapping (CSA and the indexer): projections are ``2*dim`` wide, split ``[a | b]``; entry
  ``w`` pools ``2m`` slots — the ``a`` halves of window ``w-1`` then the ``b`` halves of window
  ``w`` (window 0's ``a`` slots weigh nothing).
The softmax runs per channel in fp32.

Per-token formulation (what makes this capturable): every token of the step first writes its
projections into the paged state (``CompressorCache.kv``/``gate``), then every token gathers
the ``m`` (or ``2m``) positions ending at itself through the block table and pools them. Only
a token that completes a window (``(t+1) % m == 0``) writes its pooled entry; every other
token writes to slot -1 (nothing). Shapes depend only on the token count and host constants,
and there is no host sync: partial windows persist across steps in the paged state.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.cache import CompressorCache
from dsv4.layers import RMSNorm
from dsv4.metadata import AttentionMetadata
from dsv4.paging import token_slots, write_rows
from dsv4.rope import RotaryEmbedding

__all__ = ["WindowPooler", "entry_capacity", "entry_visible"]


def entry_capacity(metadata: AttentionMetadata, rate: int) -> int:
    """Most entries one request can have: its maximum context divided by the rate (static)."""
    return int(metadata.block_table.shape[1]) * metadata.block_size // rate


def entry_visible(entries: torch.Tensor, positions: torch.Tensor, rate: int) -> torch.Tensor:
    """Whether entry index ``entries[t, k]`` is complete for the query at ``positions[t]``."""
    return (entries + 1) * rate <= positions.unsqueeze(-1) + 1


class WindowPooler(nn.Module):
    """Parameters and paged update shared by the compressors and the indexer's key compressor."""

    def __init__(self, hidden_size: int, dim: int, rate: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim = dim
        self.rate = rate
        self.overlap = overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)

    def update(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        cache: CompressorCache,
        metadata: AttentionMetadata,
        rope: RotaryEmbedding,
    ) -> None:
        """Record this step's tokens and write every entry a token of the step completes."""
        rows = metadata.token_request
        kv = self.kv_proj(hidden_states)
        gate = self.gate_proj(hidden_states) + self.position_bias[positions % self.rate]
        write_rows(cache.kv, metadata.slot_mapping, kv)
        write_rows(cache.gate, metadata.slot_mapping, gate)

        span = 2 * self.rate if self.overlap else self.rate
        offsets = torch.arange(1 - span, 1, device=positions.device)
        window = positions.unsqueeze(-1) + offsets
        slots = token_slots(metadata, rows.unsqueeze(-1), window.clamp(min=0))
        kv_w, gate_w = cache.kv[slots], cache.gate[slots]
        if self.overlap:
            m, d = self.rate, self.dim
            kv_w = torch.cat((kv_w[:, :m, :d], kv_w[:, m:, d:]), dim=1)
            gate_w = torch.cat((gate_w[:, :m, :d], gate_w[:, m:, d:]), dim=1)
            gate_w = gate_w.masked_fill((window < 0).unsqueeze(-1), float("-inf"))
        weights = gate_w.softmax(dim=1, dtype=torch.float32).to(kv_w.dtype)
        pooled = self.kv_norm((kv_w * weights).sum(dim=1))
        starts = positions - positions % self.rate
        entry = rope.rotate(pooled, rope.tables(starts, pooled.dtype, self.dim))

        completes = ((positions + 1) % self.rate == 0) & (metadata.slot_mapping >= 0)
        entry_slots = token_slots(metadata, rows, positions // self.rate)
        write_rows(cache.entries, torch.where(completes, entry_slots, -1), entry)
