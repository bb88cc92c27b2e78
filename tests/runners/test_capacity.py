"""Capacity options: the cache layout follows from the KV budget and the model's cache bytes per
token, checked against hand-derived figures and against the caches actually allocated."""

from __future__ import annotations

import argparse

import pytest
import torch

from dsv4.cache import CacheBytes, allocate_kv_caches, cache_bytes, entry_rate, lookback
from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config
from runners.capacity import Capacity, CapacityError
from runners.cli.values import byte_count
from runners.engine import RequestTooLongError, SamplingParams
from runners.spec import EngineSpec, build_engine

CPU = torch.device("cpu")


def test_cache_bytes_are_the_hand_derived_sizes_of_each_layer_type() -> None:
    config = DeepseekV4Config.tiny()  # CSA rate 4 (the finest), HCA rate 16: stride 4
    head, index = config.head_dim, config.index_head_dim
    b = 2  # bfloat16; the compressor gates stay float32 (4 bytes)
    # per token: the window latent, + compressor kv and gate (2 * dim wide when overlapping,
    # for CSA and its indexer); per entry block of 8 finest-rate entries: the pooled entries
    # (CSA: + the indexer's keys), of which HCA completes one every 4, so 8 / gcd(4, 8) = 2
    expected = {
        SLIDING: CacheBytes(per_token=head * b, per_entry_block=0),
        HCA: CacheBytes(per_token=head * b + head * (b + 4), per_entry_block=2 * head * b),
        CSA: CacheBytes(
            per_token=head * b + 2 * head * (b + 4) + 2 * index * (b + 4),
            per_entry_block=8 * (head * b + index * b),
        ),
    }
    assert cache_bytes(config, torch.bfloat16, 8) == expected


@pytest.mark.parametrize(("block_size", "hca_rows"), [(1, 1), (2, 1), (6, 3), (8, 2), (16, 4)])
def test_hca_entries_take_the_rows_their_rate_fills(block_size: int, hca_rows: int) -> None:
    """HCA rows per entry block: ``block_size / gcd(4, block_size)``; CSA keeps one per entry."""
    config = DeepseekV4Config.tiny()
    caches = allocate_kv_caches(
        config, num_blocks=1, block_size=block_size, num_entry_blocks=5, dtype=torch.float32
    )
    rows = {
        t: layer.compressor.entries.shape[0]
        for t, layer in zip(config.layer_types, caches.layers, strict=True)
        if layer.compressor is not None
    }
    assert rows == {CSA: 5 * block_size + 1, HCA: 5 * hca_rows + 1}  # + the sink row


def test_cache_bytes_account_for_every_allocated_cache_byte() -> None:
    config = DeepseekV4Config.tiny()
    caches = allocate_kv_caches(
        config, num_blocks=3, block_size=2, num_entry_blocks=5, dtype=torch.float32
    )
    allocated = sum(t.numel() * t.element_size() for t in caches.tensors())
    sizes = [cache_bytes(config, torch.float32, 2)[t] for t in config.layer_types]
    per_token = sum(s.per_token for s in sizes)
    per_entry_block = sum(s.per_entry_block for s in sizes)
    # one write-sink row per tensor in each pool
    sinks = sum(
        t[0].numel() * t.element_size() for layer in caches.layers for t in layer.entry_tensors()
    )
    assert allocated == (3 * 2 + 1) * per_token + 5 * per_entry_block + sinks


def _block_bytes(config: DeepseekV4Config, block_size: int) -> tuple[int, int]:
    sizes = [cache_bytes(config, torch.float32, block_size)[t] for t in config.layer_types]
    per_token = sum(s.per_token for s in sizes)
    return block_size * per_token, sum(s.per_entry_block for s in sizes)


def test_a_request_holds_its_lookback_of_blocks_and_all_its_entries() -> None:
    config = DeepseekV4Config.tiny()  # lookback 16, entry rate 4
    assert (lookback(config), entry_rate(config)) == (16, 4)
    plan = Capacity(max_model_len=1024, max_num_seqs=16, block_size=8, kv_cache_memory=2**30).plan(
        config, torch.float32, CPU, chunk=32
    )
    # blocks: ceil((16 - 1 + 32) / 8) + 1 = 7 per request; entries: 1024 // 4 = 256 -> 32 blocks
    assert plan.layout.num_blocks == 16 * 7
    assert plan.layout.num_entry_blocks == 16 * 32
    assert plan.layout.max_blocks_per_row == 128 and plan.layout.max_rows == 16
    block, entry = _block_bytes(config, 8)
    assert plan.kv_cache_bytes == 16 * 7 * block + 16 * 32 * entry
    assert plan.note is None


def test_a_smaller_budget_shrinks_both_pools_in_proportion() -> None:
    config = DeepseekV4Config.tiny()
    block, entry = _block_bytes(config, 8)
    per_request = 7 * block + 32 * entry
    budget = 4 * per_request + 100  # four of the sixteen requests at their longest
    plan = Capacity(max_model_len=1024, max_num_seqs=16, block_size=8, kv_cache_memory=budget).plan(
        config, torch.float32, CPU, chunk=32
    )
    assert (plan.layout.num_blocks, plan.layout.num_entry_blocks) == (4 * 7, 4 * 32)
    assert plan.kv_cache_bytes <= budget


def test_the_default_max_model_len_is_capped_by_the_budget_with_a_note() -> None:
    config = DeepseekV4Config.tiny()
    block, entry = _block_bytes(config, 16)
    # 3 blocks (lookback 16 + chunk 16) and 5 entry blocks hold 320 tokens: 320 // 4 = 80 entries
    plan = Capacity(block_size=16, kv_cache_memory=3 * block + 5 * entry).plan(
        config, torch.float32, CPU, chunk=16
    )
    assert plan.max_model_len == 320 < config.max_position_embeddings
    assert plan.note is not None and "capped to 320 tokens" in plan.note
    uncapped = Capacity(block_size=16, kv_cache_memory=2**30).plan(
        config, torch.float32, CPU, chunk=16
    )
    assert uncapped.max_model_len == config.max_position_embeddings and uncapped.note is None


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        (
            {"max_model_len": 2048},
            "max_model_len 2048 exceeds the model's max_position_embeddings 1024",
        ),
        ({"max_model_len": 1024, "kv_cache_memory": 2**16}, "needs 0.2 MiB of KV cache"),
        ({"kv_cache_memory": 100}, "holds no block of 16 tokens"),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(
    capacity: dict[str, int], message: str
) -> None:
    with pytest.raises(CapacityError, match=message) as refused:
        Capacity(**capacity).plan(DeepseekV4Config.tiny(), torch.float32, CPU, chunk=64)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_num_seqs": 0},
        {"block_size": -1},
        {"memory_fraction": 1.5},
        {"kv_cache_memory": 2**20, "memory_fraction": 0.5},
    ],
)
def test_invalid_choices_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(CapacityError):
        Capacity(**fields)  # type: ignore[arg-type]


def test_engine_refuses_before_loading_and_serves_the_derived_layout() -> None:
    with pytest.raises(CapacityError, match="exceeds the model's max_position_embeddings"):
        build_engine(EngineSpec(platform="cpu", max_model_len=4096))
    engine = build_engine(
        EngineSpec(
            platform="cpu",
            cudagraph_mode="NONE",
            max_model_len=64,
            max_num_seqs=2,
            block_size=8,
            kv_cache_memory=2**24,
        )
    )
    layout = engine.runner.layout
    assert (layout.max_rows, layout.block_size, layout.max_blocks_per_row) == (2, 8, 8)
    assert engine.runner.limits.max_context == 64
    assert engine.runner.context_buckets.widths == (8,)


def test_a_max_model_len_between_block_boundaries_is_held_as_given() -> None:
    spec = EngineSpec(platform="cpu", cudagraph_mode="NONE", max_model_len=60, block_size=8)
    engine = build_engine(spec)
    assert engine.runner.layout.max_blocks_per_row == 8  # 64 tokens addressable
    assert engine.capacity is not None and engine.capacity.max_model_len == 60
    params = SamplingParams(max_tokens=1)
    engine.llm.check([1] * 60, params)
    with pytest.raises(RequestTooLongError, match="exceeds the maximum context of 60 tokens"):
        engine.llm.check([1] * 61, params)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1048576", 2**20), ("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30), ("1.5g", 3 * 2**29)],
)
def test_byte_counts_take_binary_units(text: str, value: int) -> None:
    assert byte_count(text) == value


@pytest.mark.parametrize("text", ["", "-5", "12 apples", "0"])
def test_bad_byte_counts_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_count(text)
