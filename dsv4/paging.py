"""Addressing the paged caches through attention metadata, with static shapes and no host sync.

Every cache tensor has ``num_blocks * block_size + 1`` rows: row ``s`` holds cache slot ``s`` and
the last row is a write sink. A write to slot -1 (padding, or a token that completes no window)
lands in the sink, so "writes nothing" costs no data-dependent branch; the sink is never read
for a visible position. All caches of a model have the same rows, so a step resolves its
slots to rows once (``sink_rows``) and every write is a single ``index_copy_``.
"""

from __future__ import annotations

import torch

from dsv4.layers import as_dtype
from dsv4.metadata import AttentionMetadata

__all__ = ["sink_rows", "token_slots", "write_rows"]


def token_slots(
    metadata: AttentionMetadata, rows: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Cache slot of ``positions`` in block-table ``rows`` (broadcast together).

    Positions beyond the table are clamped to its last block: only invisible (masked) or
    padded lookups can reach them, so what they read does not matter, but they never fault.
    """
    size = metadata.block_size
    last_block = metadata.block_table.shape[1] - 1
    blocks = metadata.block_table[rows, (positions // size).clamp(0, last_block)]
    return blocks * size + positions % size


def sink_rows(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The cache rows ``slots`` write to: the slot itself, or the sink row for slot -1."""
    return torch.where(slots >= 0, slots, cache.shape[0] - 1)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[rows[i]] = values[i]`` for rows resolved by ``sink_rows``."""
    cache.index_copy_(0, rows, as_dtype(values, cache.dtype))
