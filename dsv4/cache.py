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
  complete, and of the previous window for the CSA overlap. ``entries`` ``[E+1, dim]`` holds
  pooled entries in a pool of its own, addressed through the request's entry blocks
  (``AttentionMetadata.entry_table``; ``dsv4.paging.EntryPages``). An entry block covers
  ``block_size`` entries at the finest rate; a layer whose rate is ``s = rate // entry_rate``
  times coarser completes an entry only every ``s`` of them, so its tensor keeps only
  ``entry_rows_per_block(s, block_size) = block_size / gcd(s, block_size)`` rows per entry
  block (``E = num_entry_blocks * rows`` rows): HCA entries do not pay for CSA's rate.

Two pools, because what may be read again differs: a token's window and compressor state is
read only while its position is within the lookback of a later query (``lookback``: the widest
sliding window or pooling span), so the blocks holding positions that left it can be freed while
the request runs; a compressed entry may be selected by every later query, so it is kept as long
as the request lives. A request with ``n`` tokens addresses ``ceil(n / block_size)`` blocks and
``ceil((n // entry_rate) / block_size)`` entry blocks (``entry_rate``: the finest rate).
Caches start zeroed; stale contents of reused blocks are never visible because visibility is
computed from positions alone.
"""

from __future__ import annotations

import math

import attrs
import torch

from dsv4.config import CSA, SLIDING, DeepseekV4Config

__all__ = [
    "CacheBytes",
    "CompressorCache",
    "LayerCache",
    "PagedKVCaches",
    "allocate_kv_caches",
    "cache_bytes",
    "entry_rate",
    "entry_rows_per_block",
    "entry_stride",
    "lookback",
    "prefix_boundary",
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
        parts = [c.tensors() for c in self._compressors()]
        return (self.kv, *(t for part in parts for t in part))

    def token_tensors(self) -> tuple[torch.Tensor, ...]:
        """The block pool's tensors: one row per token slot (window latent, compressor and
        indexer projections)."""
        return (self.kv, *(t for c in self._compressors() for t in (c.kv, c.gate)))

    def entry_tensors(self) -> tuple[torch.Tensor, ...]:
        """The entry pool's tensors: one row per entry slot."""
        return tuple(c.entries for c in self._compressors())

    def _compressors(self) -> tuple[CompressorCache, ...]:
        return tuple(c for c in (self.compressor, self.indexer) if c is not None)


@attrs.frozen(kw_only=True, eq=False)
class PagedKVCaches:
    """Every layer's paged tensors; the runner owns this object and registers ``tensors()``."""

    num_blocks: int
    block_size: int
    num_entry_blocks: int
    layers: tuple[LayerCache, ...]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every cache tensor (to register as static memory for capture audits)."""
        return tuple(t for layer in self.layers for t in layer.tensors())


def entry_stride(config: DeepseekV4Config, layer_type: str) -> int:
    """Finest-rate entries per entry of a ``layer_type`` layer, rounded down (at least 1):
    entry ``w`` of such a layer is addressed as the finest-rate entry ``w * stride``, which is
    complete no later than it, so it lies in an entry block its request already holds."""
    return config.compress_rate(layer_type) // entry_rate(config)


def entry_rows_per_block(stride: int, block_size: int) -> int:
    """Rows of one entry block a layer of ``stride`` uses: the distinct ``(w * stride) %
    block_size`` are the multiples of ``gcd(stride, block_size)`` below ``block_size``."""
    return block_size // math.gcd(stride, block_size)


def _compressor_cache(
    rows: int,
    entry_rows: int,
    dim: int,
    overlap: bool,
    device: torch.device | str,
    dtype: torch.dtype,
) -> CompressorCache:
    width = 2 * dim if overlap else dim
    return CompressorCache(
        kv=torch.zeros(rows, width, device=device, dtype=dtype),
        gate=torch.zeros(rows, width, device=device, dtype=torch.float32),
        entries=torch.zeros(entry_rows, dim, device=device, dtype=dtype),
    )


def entry_rate(config: DeepseekV4Config) -> int:
    """The finest compression rate of ``config``'s layers (entry slots per token are counted at
    it); 1 for a model without compressed layers."""
    rates = [config.compress_rate(t) for t in config.layer_types if t != SLIDING]
    return min(rates, default=1)


def lookback(config: DeepseekV4Config) -> int:
    """How many positions ending at a query its layers read from the window pool: the sliding
    window, or a compressor's pooling span (``2m`` when overlapping) if wider. Positions more
    than ``lookback - 1`` before every later query are never read again."""
    spans = [
        config.compress_rate(t) * (2 if t == CSA else 1) for t in config.layer_types if t != SLIDING
    ]
    return max([config.sliding_window, *spans])


def prefix_boundary(config: DeepseekV4Config, block_size: int) -> int | None:
    """Where requests may share one request's caches (a prefix-cache hit's end, ``P``): the
    least common multiple of ``block_size * entry_rate`` and every compression rate, or ``None``
    when some rate is not a multiple of the finest.

    At a multiple ``P`` of it, each block of positions before ``P`` is complete; every
    compression window ends at ``P``, so a layer of rate ``m = s * entry_rate`` has completed
    exactly its entries ``w < P/m``, addressed as finest-rate entries ``w * s < P/entry_rate``:
    they fill exactly the first ``P / (entry_rate * block_size)`` entry blocks, and entry
    ``P/m``, the first one a continuation writes, is the first of the next entry block. So
    nothing a continuation writes lands in a block shared with the request that computed
    ``P``'s prefix. A rate that is not a multiple of the finest addresses its entries behind the
    finest ones (``entry_stride`` rounds down): its unfinished entries would share entry blocks
    with finished ones at every boundary."""
    finest = entry_rate(config)
    rates = {config.compress_rate(t) for t in config.layer_types if t != SLIDING}
    if any(rate % finest for rate in rates):
        return None
    return math.lcm(block_size * finest, *rates)


def allocate_kv_caches(
    config: DeepseekV4Config,
    *,
    num_blocks: int,
    block_size: int,
    num_entry_blocks: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PagedKVCaches:
    """Zeroed caches for ``num_blocks`` blocks of ``block_size`` tokens and ``num_entry_blocks``
    blocks of ``block_size`` entries (``None``: as many as token blocks, never too few), every
    layer."""
    entry_blocks = num_blocks if num_entry_blocks is None else num_entry_blocks
    if min(num_blocks, block_size, entry_blocks) < 1:
        raise ValueError(
            f"need at least one block of one token, got {num_blocks} x {block_size} "
            f"({entry_blocks} entry blocks)"
        )
    rows = num_blocks * block_size + 1
    layers = []
    for layer_type in config.layer_types:
        compressed = layer_type != SLIDING
        csa = layer_type == CSA
        entry_rows = (
            entry_blocks * entry_rows_per_block(entry_stride(config, layer_type), block_size) + 1
            if compressed
            else 0
        )
        layers.append(
            LayerCache(
                kv=torch.zeros(rows, config.head_dim, device=device, dtype=dtype),
                compressor=(
                    _compressor_cache(rows, entry_rows, config.head_dim, csa, device, dtype)
                    if compressed
                    else None
                ),
                indexer=(
                    _compressor_cache(rows, entry_rows, config.index_head_dim, True, device, dtype)
                    if csa
                    else None
                ),
            )
        )
    return PagedKVCaches(
        num_blocks=num_blocks,
        block_size=block_size,
        num_entry_blocks=entry_blocks,
        layers=tuple(layers),
    )


@attrs.frozen
class CacheBytes:
    """Cache bytes of one layer: per token slot (window pool) and per entry block of
    ``block_size`` finest-rate entries (entry pool: the rows its rate uses of the block)."""

    per_token: int
    per_entry_block: int


def cache_bytes(
    config: DeepseekV4Config, dtype: torch.dtype, block_size: int
) -> dict[str, CacheBytes]:
    """``CacheBytes`` of one layer of each layer type, for caches in ``dtype`` (the fp32 gates
    included) and blocks of ``block_size``: measured on caches of one block allocated on the
    meta device (less the sink rows), so it always matches ``allocate_kv_caches``."""
    caches = allocate_kv_caches(
        config, num_blocks=1, block_size=block_size, device="meta", dtype=dtype
    )
    sizes = {}
    for layer_type, layer in zip(config.layer_types, caches.layers, strict=True):
        sizes[layer_type] = CacheBytes(
            per_token=sum(t[0].numel() * t.element_size() for t in layer.token_tensors()),
            per_entry_block=sum(
                (t.shape[0] - 1) * t[0].numel() * t.element_size() for t in layer.entry_tensors()
            ),
        )
    return sizes
