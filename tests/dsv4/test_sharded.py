"""A checkpoint split into shards listed by ``model.safetensors.index.json`` is one checkpoint;
a shard the index names but the directory lacks is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.checkpoint import INDEX_FILE
from dsv4.errors import CheckpointError
from dsv4.testing import run_schedule

PROMPT = list(range(1, 20))


def _shard(directory: Path, shards: int) -> list[str]:
    """Split ``directory/model.safetensors`` into ``shards`` files plus an index."""
    single = directory / "model.safetensors"
    with safe_open(str(single), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    single.unlink()
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, name in enumerate(names):
        part = {k: v for j, (k, v) in enumerate(sorted(tensors.items())) if j % shards == i}
        save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


def test_a_sharded_checkpoint_loads_as_one(tmp_path: Path) -> None:
    config = DeepseekV4Config.tiny()
    whole = save_random_checkpoint(tmp_path / "whole", config, seed=4)
    sharded = save_random_checkpoint(tmp_path / "sharded", config, seed=4)
    _shard(sharded, 3)
    schedule = [[(0, len(PROMPT))]]
    expected = run_schedule(load_checkpoint(whole), [PROMPT], schedule)[0]
    assert torch.equal(run_schedule(load_checkpoint(sharded), [PROMPT], schedule)[0], expected)


def test_a_shard_named_by_the_index_but_missing_is_one_line(tmp_path: Path) -> None:
    directory = save_random_checkpoint(tmp_path / "ckpt", DeepseekV4Config.tiny(), seed=4)
    names = _shard(directory, 2)
    (directory / names[1]).unlink()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory)
    assert str(error.value) == (
        f"shard {names[1]!r} named by {INDEX_FILE} is missing from {directory}"
    )
