"""Capacity options: the cache layout follows from the KV budget and the model's cache bytes per
token, checked against hand-derived figures and against the caches actually allocated."""

from __future__ import annotations

import argparse

import pytest
import torch

from dsv4.cache import allocate_kv_caches, bytes_per_token
from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config
from runners.capacity import Capacity, CapacityError
from runners.cli.values import byte_count
from runners.spec import EngineSpec, build_engine

CPU = torch.device("cpu")


def test_bytes_per_token_are_the_hand_derived_sizes_of_each_layer_type() -> None:
    config = DeepseekV4Config.tiny()
    head, index = config.head_dim, config.index_head_dim
    b = 2  # bfloat16; the compressor gates stay float32 (4 bytes)
    # sliding: the window latent; HCA: + compressor kv, gate, entries; CSA: both halves of the
    # overlapping compressor and indexer (kv and gate 2 * dim wide), + their entries
    expected = {
        SLIDING: head * b,
        HCA: head * b + head * b + head * 4 + head * b,
        CSA: head * b + 2 * head * (b + 4) + head * b + 2 * index * (b + 4) + index * b,
    }
    assert bytes_per_token(config, torch.bfloat16) == expected


def test_bytes_per_token_account_for_every_allocated_cache_byte() -> None:
    config = DeepseekV4Config.tiny()
    caches = allocate_kv_caches(config, num_blocks=3, block_size=2, dtype=torch.float32)
    allocated = sum(t.numel() * t.element_size() for t in caches.tensors())
    per_type = bytes_per_token(config, torch.float32)
    per_token = sum(per_type[t] for t in config.layer_types)
    assert allocated == (3 * 2 + 1) * per_token  # one write-sink row per tensor


def _per_token(config: DeepseekV4Config, dtype: torch.dtype) -> int:
    per_type = bytes_per_token(config, dtype)
    return sum(per_type[t] for t in config.layer_types)


def test_the_budget_sets_the_number_of_blocks() -> None:
    config = DeepseekV4Config.tiny()
    per_token = _per_token(config, torch.float32)
    budget = 100 * 8 * per_token + 5  # room for 100 blocks of 8 tokens
    plan = Capacity(max_model_len=256, max_num_seqs=16, block_size=8, kv_cache_memory=budget).plan(
        config, torch.float32, CPU
    )
    assert plan.layout.num_blocks == 100
    assert plan.layout.max_blocks_per_row == 32 and plan.layout.max_rows == 16
    assert plan.to_dict()["kv_cache_bytes"] == 100 * 8 * per_token <= budget
    assert plan.note is None


def test_blocks_never_exceed_what_every_sequence_at_full_length_needs() -> None:
    config = DeepseekV4Config.tiny()
    plan = Capacity(max_model_len=100, max_num_seqs=3, block_size=16, kv_cache_memory=2**30).plan(
        config, torch.float32, CPU
    )
    assert plan.layout.max_blocks_per_row == 7  # ceil(100 / 16)
    assert plan.layout.num_blocks == 3 * 7


def test_the_default_max_model_len_is_capped_by_the_budget_with_a_note() -> None:
    config = DeepseekV4Config.tiny()
    per_token = _per_token(config, torch.float32)
    plan = Capacity(block_size=16, kv_cache_memory=20 * 16 * per_token).plan(
        config, torch.float32, CPU
    )
    assert plan.max_model_len == 320 < config.max_position_embeddings
    assert plan.note is not None and "capped to 320 tokens" in plan.note
    uncapped = Capacity(block_size=16, kv_cache_memory=2**30).plan(config, torch.float32, CPU)
    assert uncapped.max_model_len == config.max_position_embeddings and uncapped.note is None


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        (
            {"max_model_len": 2048},
            "max_model_len 2048 exceeds the model's max_position_embeddings 1024",
        ),
        ({"max_model_len": 512, "kv_cache_memory": 2**16}, "needs 0.8 MiB of KV cache"),
        ({"kv_cache_memory": 100}, "holds no block of 16 tokens"),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(
    capacity: dict[str, int], message: str
) -> None:
    with pytest.raises(CapacityError, match=message) as refused:
        Capacity(**capacity).plan(DeepseekV4Config.tiny(), torch.float32, CPU)
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
