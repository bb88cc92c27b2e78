"""Addressing the paged caches through attention metadata, with static shapes and no host sync.

Every cache tensor has ``num_blocks * block_size + 1`` rows: row ``s`` holds cache slot ``s`` and
the last row is a write sink. A write to slot -1 (padding, or a token that completes no window)
lands in the sink, so "writes nothing" costs no data-dependent branch; the sink is never read
for a visible position. All caches of a model have the same rows, so a step resolves its
slots to rows once (``sink_rows``) and every write is a single ``index_copy_``; every read of
cache rows is a single ``index_select`` (``dsv4.layers.read_rows``).

A layer resolves its tokens' block-table rows once per step (``request_blocks``); every lookup
is then one gather plus the offset in the block (``token_slots``). Entries are looked up in the
entry pool through the entry table (``EntryPages``): entry ``w`` of a layer whose rate is
``stride`` times the finest is the finest-rate entry ``f = w * stride``, in entry block
``f // block_size`` of its request, at row ``(f % block_size) // gcd(stride, block_size)`` of
that block's ``entry_rows_per_block`` rows (one entry tensor per layer, each with its own rows
per block). Every position looked up is below the table's ``width * block_size``: a query reads
positions up to its own, and entries up to its request's capacity; metadata refuses a position
its row's blocks do not cover.
"""

from __future__ import annotations

import attrs
import torch

from dsv4.cache import entry_rows_per_block
from dsv4.layers import as_dtype, read_rows
from dsv4.metadata import AttentionMetadata
from dsv4.native_ops import SCATTER_ROWS_, rows_take

__all__ = ["EntryPages", "Window", "request_blocks", "sink_rows", "token_slots", "write_rows"]


def request_blocks(metadata: AttentionMetadata) -> torch.Tensor:
    """``[T, width]`` first cache slot of each block of every token's request."""
    return read_rows(metadata.block_table, metadata.token_request) * metadata.block_size


def token_slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots ``[T, K]`` of ``positions`` (each ``>= 0``) of every token's request, given
    its ``request_blocks``: per token ``[T, K]``, or the same ``[K]`` for every token."""
    if positions.dim() == 1:
        return blocks.index_select(1, positions // block_size) + positions % block_size
    return blocks.gather(1, positions // block_size) + positions % block_size


@attrs.frozen(kw_only=True, eq=False)
class EntryPages:
    """Where the entries of one layer live for every token's request (see the module
    docstring): its entry blocks, and the layer's stride over the finest rate."""

    blocks: torch.Tensor
    """``[T, entry width]`` entry block ids of every token's request."""
    block_size: int
    stride: int

    @classmethod
    def of(cls, metadata: AttentionMetadata, stride: int) -> EntryPages:
        blocks = read_rows(metadata.entry_table, metadata.token_request)
        return cls(blocks=blocks, block_size=metadata.block_size, stride=stride)

    def rows(self, entries: torch.Tensor) -> torch.Tensor:
        """Rows ``[T, K]`` of the layer's entry tensor holding ``entries`` (each ``>= 0``) of
        every token's request: per token ``[T, K]``, or the same ``[K]`` for every token."""
        finest = entries * self.stride
        per_block = entry_rows_per_block(self.stride, self.block_size)
        index = finest // self.block_size
        if entries.dim() == 1:
            first = self.blocks.index_select(1, index)
        else:
            first = self.blocks.gather(1, index)
        # the block's rows hold offsets 0, g, 2g, ... (g = block_size / per_block)
        return first * per_block + (finest % self.block_size) // (self.block_size // per_block)


@attrs.frozen(kw_only=True, eq=False)
class Window:
    """The ``L`` positions ending at each token's own, and their cache slots."""

    positions: torch.Tensor
    """``[T, L]``; negative before the request's start."""
    slots: torch.Tensor
    """``[T, L]``; positions before the start read position 0 (callers mask or weigh them)."""

    @classmethod
    def ending_at(
        cls, positions: torch.Tensor, length: int, blocks: torch.Tensor, block_size: int
    ) -> Window:
        """The window of ``length`` positions ending at ``positions`` ``[T, 1]``."""
        window = positions + torch.arange(1 - length, 1, device=positions.device)
        return cls(positions=window, slots=token_slots(blocks, window.clamp(min=0), block_size))

    def last(self, length: int) -> Window:
        """The trailing ``length`` positions (a view; no op when it is the whole window)."""
        if length == self.positions.shape[1]:
            return self
        return Window(positions=self.positions[:, -length:], slots=self.slots[:, -length:])


def sink_rows(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The cache rows ``slots`` write to: the slot itself, or the sink row for slot -1 (the
    last row: ``-1`` modulo the row count, as ``remainder`` takes the divisor's sign)."""
    return slots % cache.shape[0]


def write_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[rows[i]] = values[i]`` for rows resolved by ``sink_rows``: one ``index_copy_``, on
    the CPU a native row copy (``scatter_rows_``) where ``rows_take``."""
    values = as_dtype(values, cache.dtype)
    if rows_take(cache, rows) and values.is_contiguous():
        SCATTER_ROWS_(cache, rows, values)
        return
    cache.index_copy_(0, rows, values)
