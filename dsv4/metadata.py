"""Attention metadata of one step: how each token of the batch addresses the paged caches.

The layout is chosen so that every tensor's shape depends only on the (padded) token count and on
constants of the cache (rows, blocks per row, block size). Hence anything the model derives from
metadata (window slots, compressed-entry slots, visibility masks) can be computed with tensor ops
of static shape, without a host sync, and captured.

Invariants:
- ``token_request[t]`` is the block-table row of token t; padded tokens use row 0 and have
  ``slot_mapping[t] == -1``: they write nothing, and their outputs are never read.
- ``slot_mapping[t] == block_table[row, pos // block_size] * block_size + pos % block_size`` for
  every real token t at position ``pos`` of its request.
- ``entry_table`` addresses the entry pool (``dsv4.cache``) as ``block_table`` does the window
  pool: entry ``w`` of a request is entry slot ``entry_table[row, w // block_size] * block_size
  + w % block_size``. Its width is ``ceil(width / entry_rate)``: it covers every entry of the
  positions ``block_table`` covers, at the finest rate.
- ``block_table`` is ``[max_rows, width]``: the first ``width`` columns of the table, where
  ``width`` (the step's context width, in blocks) covers every position of the step. Attention
  reads compressed entries up to ``width * block_size`` positions, so a step's cost follows its
  width, not the table's full width. Entries past a row's blocks, and rows no token of the step
  uses, are never read for a visible position: ``new_metadata`` zeroes them; ``MetadataBuffers``
  rewrites only rows whose blocks changed since it last wrote them and leaves the rest as they
  were, and its narrower tables are column views of one buffer (address-stable).

Metadata is built from chunks: anything with a block-table ``row``, its ``block_ids``, a
``start_position`` and ``num_tokens`` (the structural ``ChunkLike``), so the model knows nothing
of the engine that schedules them.

Two ways to build it, one per runner policy, both staging host tensors (``stage_into``: pinned
and non-blocking on a GPU, so a step never drains the stream to copy its metadata):
- ``new_metadata``: fresh tensors every step (V1; not address-stable).
- ``MetadataBuffers.write``: rewrite persistent buffers in place and return views of them (V2;
  address-stable, so captured work that reads them stays correct on replay). Host cost per step
  is one host tensor and one copy per per-token buffer, plus one row copy per request whose
  blocks changed (a decode step usually changes none).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from typing_extensions import Protocol

__all__ = [
    "AttentionMetadata",
    "ChunkLike",
    "MetadataBuffers",
    "entry_width",
    "new_metadata",
    "stage_into",
]


class ChunkLike(Protocol):
    """One request's tokens in a step, as metadata needs them (host values only)."""

    @property
    def row(self) -> int:
        """Block-table row that holds the request (stable while the request lives)."""

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Cache blocks owned by the request, in order; they cover every position written."""

    @property
    def start_position(self) -> int:
        """Position of the chunk's first token (= tokens already in the cache)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the chunk feeds (at least one)."""

    @property
    def entry_block_ids(self) -> tuple[int, ...]:
        """Entry blocks owned by the request, in order; they cover every entry a token of the
        chunk completes (at the finest rate)."""


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """Per-step metadata the attention layers read from the forward context."""

    token_request: torch.Tensor
    """``[T]`` int64: block-table row of each token."""
    slot_mapping: torch.Tensor
    """``[T]`` int64: flat cache slot each token is written to; -1 writes nothing."""
    block_table: torch.Tensor
    """``[max_rows, width]`` int64: the first ``width`` cache blocks of each row."""
    block_size: int
    """Tokens per cache block (a host constant of the cache, never of the step)."""
    entry_table: torch.Tensor
    """``[max_rows, ceil(width / entry_rate)]`` int64: the first entry blocks of each row."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_request.shape[0])


def _host_rows(
    chunks: Sequence[ChunkLike], num_tokens: int, block_size: int, max_blocks: int
) -> tuple[list[int], list[int], list[int]]:
    """Token rows, slots and positions (padding: row 0, slot -1, position 0)."""
    rows: list[int] = []
    slots: list[int] = []
    positions: list[int] = []
    for chunk in chunks:
        for pos in range(chunk.start_position, chunk.start_position + chunk.num_tokens):
            block = pos // block_size
            if block >= len(chunk.block_ids) or block >= max_blocks:
                raise ValueError(
                    f"position {pos} of row {chunk.row} is not covered by its "
                    f"{len(chunk.block_ids)} cache blocks (block size {block_size}, "
                    f"at most {max_blocks} blocks per row)"
                )
            rows.append(chunk.row)
            slots.append(chunk.block_ids[block] * block_size + pos % block_size)
            positions.append(pos)
    if len(rows) > num_tokens:
        raise ValueError(f"{len(rows)} scheduled tokens exceed the padded size {num_tokens}")
    pad = num_tokens - len(rows)
    return rows + [0] * pad, slots + [-1] * pad, positions + [0] * pad


def _check_row(chunk: ChunkLike, max_rows: int) -> None:
    if not 0 <= chunk.row < max_rows:
        raise ValueError(f"row {chunk.row} outside the block table's {max_rows} rows")


def _host_table(
    chunks: Sequence[ChunkLike], max_rows: int, max_blocks: int, *, entries: bool
) -> torch.Tensor:
    table = torch.zeros(max_rows, max_blocks, dtype=torch.int64)
    for chunk in chunks:
        _check_row(chunk, max_rows)
        ids = (chunk.entry_block_ids if entries else chunk.block_ids)[:max_blocks]
        table[chunk.row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return table


def entry_width(width: int, entry_rate: int) -> int:
    """Entry blocks covering the entries of ``width`` blocks of positions at ``entry_rate``."""
    return -(-width // entry_rate)


def new_metadata(
    chunks: Sequence[ChunkLike],
    *,
    num_tokens: int,
    block_size: int,
    max_rows: int,
    max_blocks: int,
    entry_rate: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Build metadata as fresh tensors, ``max_blocks`` wide; also return the ``[T]``
    positions. Each is staged from a host tensor (``stage_into``), as ``MetadataBuffers``
    stages: three copies a step, none of them from pageable memory."""
    per_token = torch.tensor(
        _host_rows(chunks, num_tokens, block_size, max_blocks), dtype=torch.int64
    )
    tables = (
        _host_table(chunks, max_rows, max_blocks, entries=False),
        _host_table(chunks, max_rows, entry_width(max_blocks, entry_rate), entries=True),
    )
    staged = [torch.empty_like(host, device=device) for host in (per_token, *tables)]
    for destination, host in zip(staged, (per_token, *tables), strict=True):
        stage_into(destination, host)
    rows, slots, positions = staged[0]
    metadata = AttentionMetadata(
        token_request=rows,
        slot_mapping=slots,
        block_table=staged[1],
        block_size=block_size,
        entry_table=staged[2],
    )
    return metadata, positions


def stage_into(destination: torch.Tensor, host: torch.Tensor) -> None:
    """Copy ``host`` into ``destination``; on a GPU from pinned memory without blocking (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if destination.is_cuda:
        destination.copy_(host.pin_memory(), non_blocking=True)
    else:
        destination.copy_(host)


class MetadataBuffers:
    """Persistent metadata buffers rewritten in place every step (address-stable)."""

    def __init__(
        self,
        *,
        max_tokens: int,
        block_size: int,
        max_rows: int,
        max_blocks: int,
        entry_rate: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.entry_rate = entry_rate
        entry_blocks = entry_width(max_blocks, entry_rate)
        self.token_request = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_rows, max_blocks, dtype=torch.int64, device=device)
        self.entry_table = torch.zeros(max_rows, entry_blocks, dtype=torch.int64, device=device)
        self._table_rows: dict[tuple[int, bool], tuple[int, ...]] = {}
        """The blocks last written to each (row, entries?) of the two tables (truncated to its
        width)."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every persistent buffer (to register as static memory for capture audits)."""
        return (self.token_request, self.slot_mapping, self.block_table, self.entry_table)

    def write(
        self,
        chunks: Sequence[ChunkLike],
        *,
        num_tokens: int,
        positions_out: torch.Tensor,
        width: int | None = None,
    ) -> AttentionMetadata:
        """Rewrite the buffers for this step; write positions into ``positions_out[:T]``. The
        metadata's table is the first ``width`` columns (all of them for ``None``)."""
        width = self.max_blocks if width is None else width
        if not 0 < width <= self.max_blocks:
            raise ValueError(f"width {width} outside 1..{self.max_blocks} blocks")
        per_token = torch.tensor(
            _host_rows(chunks, num_tokens, self.block_size, width), dtype=torch.int64
        )
        for chunk in chunks:
            _check_row(chunk, self.max_rows)
            self._write_table_row(self.block_table, chunk.row, chunk.block_ids, entries=False)
            self._write_table_row(self.entry_table, chunk.row, chunk.entry_block_ids, entries=True)
        stage_into(self.token_request[:num_tokens], per_token[0])
        stage_into(self.slot_mapping[:num_tokens], per_token[1])
        stage_into(positions_out[:num_tokens], per_token[2])
        return AttentionMetadata(
            token_request=self.token_request[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_table=self.block_table[:, :width],
            block_size=self.block_size,
            entry_table=self.entry_table[:, : entry_width(width, self.entry_rate)],
        )

    def _write_table_row(
        self, table: torch.Tensor, row: int, block_ids: tuple[int, ...], *, entries: bool
    ) -> None:
        ids = block_ids[: table.shape[1]]
        if self._table_rows.get((row, entries)) == ids:
            return
        stage_into(table[row, : len(ids)], torch.tensor(ids, dtype=torch.int64))
        table[row, len(ids) :].zero_()
        self._table_rows[row, entries] = ids
