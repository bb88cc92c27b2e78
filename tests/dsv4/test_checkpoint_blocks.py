"""``load_checkpoint`` reads block by block (``dsv4.shard_reader``, ``chunk_budget``): the model
it builds is bit-identical whatever the block size, in every dtype and layout, and a bad value in
any block is reported exactly as a whole-tensor check reports it (count over the tensor, first
index in tensor coordinates). A truncated shard is named as truncated."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.errors import CheckpointError
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.quantized_writer import save_random_quantized_checkpoint
from dsv4.shard_reader import index_chunks

TINY = DeepseekV4Config.tiny()
PARTIAL = attrs.evolve(TINY, hidden_size=96, head_dim=48, q_lora_rank=160, moe_intermediate_size=96)
"""160-row FP8 weights: two row blocks of 128, the second partial."""
SMALL_BLOCKS = 4096
"""Bytes per block in the block-wise loads below: most tensors take several."""


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def _rewrite(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(source, target)
    tensors = _tensors(target)
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def _official(tensors: dict[str, torch.Tensor]) -> None:
    """HF expert stacks -> official per-expert ``w1``/``w2``/``w3`` pieces."""
    for key in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        layer = key.removesuffix(".mlp.experts.gate_up_proj").removeprefix("model.")
        gate_up, down = tensors.pop(key), tensors.pop(key.replace("gate_up_proj", "down_proj"))
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            prefix = f"{layer}.ffn.experts.{e}"
            tensors[f"{prefix}.w1.weight"] = gate_up[e, :half].clone()
            tensors[f"{prefix}.w3.weight"] = gate_up[e, half:].clone()
            tensors[f"{prefix}.w2.weight"] = down[e].clone()


def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsv4.checkpoint.chunk_budget", lambda model_bytes: SMALL_BLOCKS)


def _state(model: DeepseekV4ForCausalLM) -> dict[str, tuple[type, torch.Tensor]]:
    """Each state tensor with the type of the module holding it."""
    return {
        name: (type(model.get_submodule(name.rpartition(".")[0])), tensor)
        for name, tensor in model.state_dict().items()
    }


def _assert_identical(a: DeepseekV4ForCausalLM, b: DeepseekV4ForCausalLM) -> None:
    left, right = _state(a), _state(b)
    assert left.keys() == right.keys()
    for name, (owner, tensor) in left.items():
        other_owner, other = right[name]
        assert owner is other_owner, name
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, name
        assert tensor.stride() == other.stride(), name  # routed experts: columns first
        bytes_of = [t.contiguous().view(torch.uint8) for t in (tensor, other)]
        assert torch.equal(*bytes_of), name


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("plain"), TINY, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("names", ["hf", "official"])
def test_plain_loads_are_identical_block_by_block(
    plain: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    names: str,
) -> None:
    directory = plain if names == "hf" else _rewrite(plain, tmp_path / "official", _official)
    whole = load_checkpoint(directory, dtype=dtype, progress=None)
    _small_blocks(monkeypatch)
    _assert_identical(load_checkpoint(directory, dtype=dtype, progress=None), whole)


@pytest.mark.parametrize(
    ("config", "expert_dtype", "dtype"),
    [
        (TINY, "fp4", torch.float32),
        (TINY, "fp4", torch.bfloat16),
        (PARTIAL, "fp8", torch.float32),
        (PARTIAL, "fp8", torch.float16),
    ],
    ids=["fp4", "fp4-bfloat16", "fp8-partial", "fp8-partial-float16"],
)
@pytest.mark.parametrize("mode", ["weight-only", "dequantize"])
def test_quantized_loads_are_identical_block_by_block(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: DeepseekV4Config,
    expert_dtype: str,
    dtype: torch.dtype,
    mode: str,
) -> None:
    directory = save_random_quantized_checkpoint(
        tmp_path, config, seed=2, expert_dtype=expert_dtype, num_shards=2
    )
    whole = load_checkpoint(directory, dtype=dtype, quantization=mode, progress=None)
    _small_blocks(monkeypatch)
    blocks = load_checkpoint(directory, dtype=dtype, quantization=mode, progress=None)
    _assert_identical(blocks, whole)


def _poke(name: str, *indices: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        for index in indices:
            tensors[name][index] = float("nan")

    return edit


def _nan_codes(name: str, *indices: tuple[int, int]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        raw = tensors[name].view(torch.uint8).clone()
        for index in indices:
            raw[index] = 0xFF
        tensors[name] = raw.view(torch.float8_e4m3fn)

    return edit


def _scale_up(name: str, rows: slice) -> Callable[[dict[str, torch.Tensor]], None]:
    """Scales of one row block of ``name`` so large the block overflows float16."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        scale = tensors[name].to(torch.float32)
        scale[rows] = 2.0**20
        tensors[name] = scale

    return edit


CASES: list[tuple[str, str, Callable[[dict[str, torch.Tensor]], None], torch.dtype, str]] = [
    (
        "plain",
        "NaN in two blocks",
        _poke("model.layers.1.mlp.experts.gate_up_proj", (3, 40, 5), (2, 7, 9)),
        torch.float32,
        "tensor 'model.layers.1.mlp.experts.gate_up_proj' in model.safetensors has non-finite "
        "values (NaN or inf): 2 of 65536, the first nan at index [2, 7, 9]; the weights are "
        "corrupt",
    ),
    (
        "fp8",
        "NaN codes in two blocks",
        _nan_codes("layers.0.attn.wq_a.weight", (150, 3), (140, 90)),
        torch.float32,
        "tensor 'layers.0.attn.wq_a.weight' in model.safetensors has NaN codes: 2 of 15360, the "
        "first at index [140, 90]; the weights are corrupt",
    ),
    (
        "fp8",
        "overflow in the second block",
        _scale_up("layers.0.attn.wq_a.scale", slice(1, 2)),
        torch.float16,
        "tensor 'layers.0.attn.wq_a.weight' in model.safetensors has values that overflow "
        "float16: {count} of 15360, the first {first:g} at index [{row}, {col}]; load it in "
        "float32 or bfloat16",
    ),
]


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fp8")
    return save_random_quantized_checkpoint(directory, PARTIAL, seed=6, expert_dtype="fp8")


def _overflow_message(message: str, tensors: dict[str, torch.Tensor]) -> str:
    """The overflow case's expected message, from the tensors themselves (dequantized whole)."""
    weight = tensors["layers.0.attn.wq_a.weight"].to(torch.float32)
    scale = tensors["layers.0.attn.wq_a.scale"].to(torch.float32)
    values = weight * scale.repeat_interleave(128, 0)[:160].repeat_interleave(128, 1)[:, :96]
    bad = ~torch.isfinite(values.to(torch.float16))
    row, col = bad.nonzero()[0].tolist()
    return message.format(count=int(bad.sum()), first=float(values[row, col]), row=row, col=col)


BAD = [
    pytest.param(*case[:1], *case[2:], mode, id=f"{case[1]}-{mode}")
    for case in CASES
    for mode in (("auto",) if case[0] == "plain" else ("weight-only", "dequantize"))
]


@pytest.mark.parametrize("blocks", ["whole", "small blocks"])
@pytest.mark.parametrize(("layout", "edit", "dtype", "message", "mode"), BAD)
def test_a_bad_value_in_any_block_is_reported_for_the_whole_tensor(
    plain: Path,
    fp8: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    blocks: str,
    layout: str,
    edit: Callable[[dict[str, torch.Tensor]], None],
    dtype: torch.dtype,
    message: str,
    mode: str,
) -> None:
    directory = _rewrite(plain if layout == "plain" else fp8, tmp_path / "bad", edit)
    if "{count}" in message:
        message = _overflow_message(message, _tensors(directory))
    if blocks == "small blocks":
        _small_blocks(monkeypatch)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, dtype=dtype, quantization=mode, progress=None)
    assert str(error.value) == message


def _header(path: Path) -> tuple[int, int]:
    """(header length, bytes of tensor data) of a safetensors file, from its own bytes."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header: dict[str, Any] = json.loads(raw[8 : 8 + length])
    data = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    return length, data


def test_a_truncated_shard_is_named_as_truncated(plain: Path, tmp_path: Path) -> None:
    directory = shutil.copytree(plain, tmp_path / "cut")
    shard = directory / "model.safetensors"
    length, data = _header(shard)
    shard.write_bytes(shard.read_bytes()[: 8 + length + data - 1000])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, progress=None)
    assert str(error.value) == (
        f"cannot read model.safetensors: the file is truncated (its header describes {data} "
        f"bytes of tensor data, the file holds {data - 1000})"
    )
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, progress=None)
    assert str(error.value) == (
        f"cannot read model.safetensors: the file is truncated (its header is {length} bytes, "
        "the file holds 92 after the 8-byte header length)"
    )


@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    element=st.sampled_from([0.5, 1, 2, 4]),
    budget=st.integers(1, 300),
)
def test_index_chunks_cover_a_tensor_in_order_within_the_budget(
    shape: list[int], element: float, budget: int
) -> None:
    """In order, every element once; each chunk within the budget unless it is one element."""
    values = torch.arange(math.prod(shape)).view(shape)
    chunks = [values[index].reshape(-1) for index in index_chunks(shape, element, budget)]
    covered = torch.cat(chunks) if chunks else values.new_empty(0)
    assert torch.equal(covered, values.reshape(-1))
    assert all(len(chunk) * element <= max(budget, element) for chunk in chunks)
