"""Paged caches of every attention layer, owned by the runner and handed to the model per step
(``ForwardContext.kv_caches``).

Layout (``S = num_blocks * block_size`` slots, plus one write-sink row, see ``dsv4.paging``):
- ``LayerCache.kv`` ``[S+1, head_dim]``: the normalised, rotated KV latent of each token. It is
  the sliding-window cache; every position keeps its slot, and a query reads the last
  ``sliding_window`` positions of its request through the block table.
- ``CompressorCache`` (CSA and HCA layers; CSA also has one for the indexer):
  ``kv``/``gate`` ``[S+1, width]`` hold each token's compressor projections (``gate`` already
  includes the fp32 position bias of the token's slot in its window, so it is kept in fp32
  whatever the cache dtype, as the reference computes it) — the state of windows not yet
  complete, and of the previous window for the CSA overlap. ``entries`` ``[S+1, dim]`` holds
  pooled entries: entry ``w`` of a request lives at the slot of position ``(w+1)*m - 1``, the
  token that completed it (so the request's own blocks always cover it).

A request with ``n`` tokens needs ``ceil(n / block_size)`` blocks; blocks are ``0..num_blocks-1``.
Caches start zeroed; stale contents of reused blocks are never visible because visibility is
computed from positions alone.
"""

from __future__ import annotations

import attrs
import torch

from dsv4.config import CSA, SLIDING, DeepseekV4Config

__all__ = [
    "CompressorCache",
    "LayerCache",
    "PagedKVCaches",
    "allocate_kv_caches",
    "bytes_per_token",
]


@attrs.frozen(kw_only=True, eq=False)
class CompressorCache:
    """Per-token projections and pooled entries of one compressor."""

    kv: torch.Tensor
    gate: torch.Tensor
    entries: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.kv, self.gate, self.entries)


@attrs.frozen(kw_only=True, eq=False)
class LayerCache:
    """The paged tensors of one attention layer."""

    kv: torch.Tensor
    compressor: CompressorCache | None
    indexer: CompressorCache | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        parts = [c.tensors() for c in (self.compressor, self.indexer) if c is not None]
        return (self.kv, *(t for part in parts for t in part))


@attrs.frozen(kw_only=True, eq=False)
class PagedKVCaches:
    """Every layer's paged tensors; the runner owns this object and registers ``tensors()``."""

    num_blocks: int
    block_size: int
    layers: tuple[LayerCache, ...]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every cache tensor (to register as static memory for capture audits)."""
        return tuple(t for layer in self.layers for t in layer.tensors())


def _compressor_cache(
    rows: int, dim: int, overlap: bool, device: torch.device | str, dtype: torch.dtype
) -> CompressorCache:
    width = 2 * dim if overlap else dim
    return CompressorCache(
        kv=torch.zeros(rows, width, device=device, dtype=dtype),
        gate=torch.zeros(rows, width, device=device, dtype=torch.float32),
        entries=torch.zeros(rows, dim, device=device, dtype=dtype),
    )


def allocate_kv_caches(
    config: DeepseekV4Config,
    *,
    num_blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PagedKVCaches:
    """Zeroed caches for ``num_blocks`` blocks of ``block_size`` tokens, every layer."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need at least one block of one token, got {num_blocks} x {block_size}")
    rows = num_blocks * block_size + 1
    layers = []
    for layer_type in config.layer_types:
        compressed = layer_type != SLIDING
        csa = layer_type == CSA
        layers.append(
            LayerCache(
                kv=torch.zeros(rows, config.head_dim, device=device, dtype=dtype),
                compressor=(
                    _compressor_cache(rows, config.head_dim, csa, device, dtype)
                    if compressed
                    else None
                ),
                indexer=(
                    _compressor_cache(rows, config.index_head_dim, True, device, dtype)
                    if csa
                    else None
                ),
            )
        )
    return PagedKVCaches(num_blocks=num_blocks, block_size=block_size, layers=tuple(layers))


def bytes_per_token(config: DeepseekV4Config, dtype: torch.dtype) -> dict[str, int]:
    """Cache bytes one token occupies in one layer of each layer type, for caches in ``dtype``
    (sliding window, compressor state and entries, indexer state and entries; the fp32 gates
    included): measured on caches of one slot allocated on the meta device, so it always
    matches ``allocate_kv_caches``."""
    caches = allocate_kv_caches(config, num_blocks=1, block_size=1, device="meta", dtype=dtype)
    return {
        layer_type: sum(t[0].numel() * t.element_size() for t in layer.tensors())
        for layer_type, layer in zip(config.layer_types, caches.layers, strict=True)
    }
