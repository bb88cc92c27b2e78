"""Entry addressing (``dsv4.paging.EntryPages``): a layer ``stride`` times coarser than the
finest rate keeps ``block_size / gcd(stride, block_size)`` rows per entry block, and still
gives every entry of every request a row of its own, among the rows of the entry block its
finest-rate index falls in (a block the request holds once the entry is complete)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4.cache import entry_rows_per_block
from dsv4.metadata import AttentionMetadata
from dsv4.paging import EntryPages


@st.composite
def _pools(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    """(stride, block size, each request's entry blocks: disjoint ids, in any order)."""
    stride = draw(st.integers(1, 40))
    block_size = draw(st.integers(1, 20))
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ids = draw(st.permutations(range(sum(sizes))))
    owned, start = [], 0
    for size in sizes:
        owned.append(list(ids[start : start + size]))
        start += size
    return stride, block_size, owned


@given(_pools())
def test_every_entry_of_every_request_has_a_row_of_its_own(
    pool: tuple[int, int, list[list[int]]],
) -> None:
    stride, block_size, owned = pool
    width = max(len(blocks) for blocks in owned)
    table = torch.zeros(len(owned), width, dtype=torch.int64)
    for row, blocks in enumerate(owned):
        table[row, : len(blocks)] = torch.tensor(blocks)
    metadata = AttentionMetadata(
        token_request=torch.arange(len(owned)),
        slot_mapping=torch.zeros(len(owned), dtype=torch.int64),
        block_table=table,
        block_size=block_size,
        entry_table=table,
    )
    pages = EntryPages.of(metadata, stride)
    # every entry whose finest-rate index the table covers: w * stride < width * block_size
    capacity = -(-width * block_size // stride)
    rows = pages.rows(torch.arange(capacity))
    per_block = entry_rows_per_block(stride, block_size)
    assert per_block == block_size // math.gcd(stride, block_size)
    seen: dict[int, tuple[int, int]] = {}
    for request, blocks in enumerate(owned):
        for entry in range(capacity):
            if entry * stride >= len(blocks) * block_size:
                break
            row = int(rows[request, entry])
            block = blocks[entry * stride // block_size]
            assert block * per_block <= row < (block + 1) * per_block  # in its own block
            assert row not in seen, f"entry {entry} of request {request} shares {seen[row]}"
            seen[row] = (request, entry)
    # stride 1 is the plain layout: entry w at slot w of the request's blocks
    if stride == 1:
        assert {r: e for r, (_, e) in seen.items()} == {
            blocks[e // block_size] * block_size + e % block_size: e
            for blocks in owned
            for e in range(len(blocks) * block_size)
        }
