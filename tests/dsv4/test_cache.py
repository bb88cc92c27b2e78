"""Paged caches: layout, the forward context hands them over, padded tokens write nothing, both
metadata builders agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache import PagedKVCaches, allocate_kv_caches, entry_rate
from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4.hf_config import config_from_hf_dict, config_to_hf_dict
from dsv4.metadata import AttentionMetadata, MetadataBuffers, new_metadata
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.testing import Chunk, configs, random_model
from graphs import ForwardContext, forward_context

BLOCK, ROWS, MAX_BLOCKS = 4, 2, 8


def _step(
    fresh: tuple[DeepseekV4ForCausalLM, PagedKVCaches],
    metadata: AttentionMetadata,
    positions: torch.Tensor,
    ids: list[int],
) -> torch.Tensor:
    model, caches = fresh
    padded = ids + [0] * (metadata.num_tokens - len(ids))
    context = ForwardContext(attn_metadata=metadata, kv_caches=caches)
    with torch.inference_mode(), forward_context(context):
        return model(torch.tensor(padded), positions)


def _chunk(row: int, start: int, count: int) -> Chunk:
    blocks = tuple(range(row * MAX_BLOCKS, (row + 1) * MAX_BLOCKS))
    return Chunk(
        row=row, block_ids=blocks, entry_block_ids=blocks, start_position=start, num_tokens=count
    )


def _fresh(config: DeepseekV4Config) -> tuple[DeepseekV4ForCausalLM, PagedKVCaches]:
    model = random_model(config, 4)
    return model, allocate_kv_caches(config, num_blocks=ROWS * MAX_BLOCKS, block_size=BLOCK)


@settings(max_examples=15)
@given(
    config=configs(max_layers=2),
    history=st.integers(1, 20),
    pads=st.integers(1, 5),
    ids=st.lists(st.integers(0, 63), min_size=20, max_size=20),
)
def test_padded_tokens_write_nothing(
    config: DeepseekV4Config, history: int, pads: int, ids: list[int]
) -> None:
    """An all-padding step leaves every cache row but the write sink bit-identical, and a
    padded batch writes exactly the rows (and gives the logits) of the unpadded one."""
    fresh = _fresh(config)
    caches = fresh[1]
    chunk = _chunk(1, 0, history)
    metadata, positions = new_metadata(
        [chunk],
        num_tokens=history,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=entry_rate(config),
    )
    unpadded_logits = _step(fresh, metadata, positions, ids[:history])
    before = [t.clone() for t in caches.tensors()]
    padding, positions = new_metadata(
        [],
        num_tokens=pads,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=entry_rate(config),
    )
    _step(fresh, padding, positions, [])
    for old, new in zip(before, caches.tensors(), strict=True):
        assert torch.equal(old[:-1], new[:-1])

    padded = _fresh(config)
    metadata, positions = new_metadata(
        [chunk],
        num_tokens=history + pads,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=entry_rate(config),
    )
    padded_logits = _step(padded, metadata, positions, ids[:history])
    torch.testing.assert_close(padded_logits[:history], unpadded_logits, rtol=1e-5, atol=1e-5)
    for old, new in zip(before, padded[1].tensors(), strict=True):
        assert torch.equal(old[:-1] != 0, new[:-1] != 0)
        torch.testing.assert_close(old[:-1], new[:-1], rtol=1e-5, atol=1e-5)


def test_persistent_and_fresh_metadata_give_equal_logits() -> None:
    config = DeepseekV4Config.tiny()
    chunks = [_chunk(0, 0, 9), _chunk(1, 0, 5)]
    metadata, positions = new_metadata(
        chunks,
        num_tokens=16,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=entry_rate(config),
    )
    ids = list(range(14))
    expected = _step(_fresh(config), metadata, positions, ids)
    buffers = MetadataBuffers(
        max_tokens=32,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=entry_rate(config),
    )
    positions = torch.zeros(32, dtype=torch.long)
    metadata = buffers.write(chunks, num_tokens=16, positions_out=positions)
    assert torch.equal(_step(_fresh(config), metadata, positions[:16], ids), expected)


def test_cache_layout_per_layer_type() -> None:
    config = DeepseekV4Config.tiny()
    caches = allocate_kv_caches(config, num_blocks=3, block_size=5, dtype=torch.float64)
    rows = 3 * 5 + 1
    by_type = dict(zip(config.layer_types, caches.layers, strict=True))
    assert by_type[SLIDING].compressor is None and by_type[SLIDING].indexer is None
    assert by_type[HCA].indexer is None
    hca, csa = by_type[HCA].compressor, by_type[CSA].compressor
    assert hca is not None and csa is not None and by_type[CSA].indexer is not None
    assert hca.kv.shape == (rows, config.head_dim)
    assert csa.kv.shape == (rows, 2 * config.head_dim)
    assert by_type[CSA].indexer.entries.shape == (rows, config.index_head_dim)
    assert len(caches.tensors()) == 1 + 4 + 7
    gates = {id(c.gate) for layer in caches.layers for c in (layer.compressor, layer.indexer) if c}
    for tensor in caches.tensors():
        assert tensor.dtype == (torch.float32 if id(tensor) in gates else torch.float64)
        assert not tensor.any()
    with pytest.raises(ValueError, match="at least one block"):
        allocate_kv_caches(config, num_blocks=0, block_size=4)


def test_running_with_the_caches_of_another_model_fails() -> None:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.tiny())
    other = config_to_hf_dict(DeepseekV4Config.tiny()) | {"num_hidden_layers": 2}
    other["layer_types"], other["mlp_layer_types"] = [SLIDING, CSA], ["moe", "moe"]
    caches = allocate_kv_caches(config_from_hf_dict(other), num_blocks=2, block_size=4)
    metadata, positions = new_metadata(
        [_chunk(0, 0, 1)],
        num_tokens=1,
        block_size=BLOCK,
        max_rows=ROWS,
        max_blocks=MAX_BLOCKS,
        entry_rate=1,
    )
    with pytest.raises(ValueError, match="caches hold 2 layers, the model has 3"):
        _step((model, caches), metadata, positions, [1])


STEP_ROWS, STEP_BLOCKS, STEP_ENTRY_RATE = 4, 5, 2
STEP_ENTRY_BLOCKS = 3  # ceil(STEP_BLOCKS / STEP_ENTRY_RATE)


@st.composite
def _step_chunks(draw: st.DrawFn) -> list[Chunk]:
    """One step's chunks: distinct rows, each with 1..STEP_BLOCKS blocks covering its tokens."""
    rows = draw(st.lists(st.integers(0, STEP_ROWS - 1), min_size=1, max_size=4, unique=True))
    chunks = []
    for row in rows:
        blocks = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=STEP_BLOCKS)))
        entries = draw(st.lists(st.integers(0, 40), min_size=1, max_size=STEP_ENTRY_BLOCKS))
        start = draw(st.integers(0, len(blocks) * BLOCK - 1))
        count = draw(st.integers(1, len(blocks) * BLOCK - start))
        chunk = Chunk(
            row=row,
            block_ids=blocks,
            entry_block_ids=tuple(entries),
            start_position=start,
            num_tokens=count,
        )
        chunks.append(chunk)
    return chunks


@given(steps=st.lists(_step_chunks(), min_size=1, max_size=6))
def test_persistent_metadata_equals_fresh_metadata_step_after_step(
    steps: list[list[Chunk]],
) -> None:
    """Over steps that add, drop and re-block rows, the persistent buffers (which rewrite only
    the block-table rows that changed) hold what fresh metadata holds wherever a token reads."""
    buffers = MetadataBuffers(
        max_tokens=128,
        block_size=BLOCK,
        max_rows=STEP_ROWS,
        max_blocks=STEP_BLOCKS,
        entry_rate=STEP_ENTRY_RATE,
    )
    positions_out = torch.zeros(128, dtype=torch.int64)
    for chunks in steps:
        num_tokens = sum(c.num_tokens for c in chunks)
        fresh, positions = new_metadata(
            chunks,
            num_tokens=num_tokens,
            block_size=BLOCK,
            max_rows=STEP_ROWS,
            max_blocks=STEP_BLOCKS,
            entry_rate=STEP_ENTRY_RATE,
        )
        persistent = buffers.write(chunks, num_tokens=num_tokens, positions_out=positions_out)
        assert torch.equal(persistent.token_request, fresh.token_request)
        assert torch.equal(persistent.slot_mapping, fresh.slot_mapping)
        assert torch.equal(positions_out[:num_tokens], positions)
        for chunk in chunks:
            assert torch.equal(persistent.block_table[chunk.row], fresh.block_table[chunk.row])
            assert torch.equal(persistent.entry_table[chunk.row], fresh.entry_table[chunk.row])
