"""The published quantized layout: what ``save_quantized_checkpoint`` writes, transformers loads
(on the CPU, with accelerate, dequantizing at load) to the very weights ``dsv4.quantization``
dequantizes from the same bytes, bit for bit in float32 (and bfloat16); both load modes run the
model to bit-identical logits, close to transformers'.

transformers' load-time dequantizer derives the block from ``dim // grid`` (REFERENCE §D, quirk
1): for a dimension above one block that is not a multiple of it (160, 192 below) it misreads
the rows/columns between ``dim // grid`` and the next block boundary. The partial-edge test
compares exactly where its block indexing agrees with the ceil grid, asserts that the misread
region is non-empty there, and that every other weight (dimensions up to one block, e.g. 96 or
64, or whole blocks) is equal everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from safetensors import safe_open

from dsv4.checkpoint import canonical_name
from dsv4.config import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.quant_formats import transformers_block_size
from dsv4.quant_layers import QuantizedExperts, QuantizedLinear, resident_bytes
from dsv4.quantization import (
    EXPERT_PIECE,
    QuantizationConfig,
    dequantize_state_dict,
    install_weight_only,
    pair_scales,
    split_quantized_state,
)
from dsv4.quantized_writer import (
    BF16_UNSCALED,
    official_name,
    save_random_quantized_checkpoint,
)
from dsv4.testing import run_schedule
from tests.dsv4.support import hf_logits

PROMPT = list(range(1, 38))
TINY = DeepseekV4Config.tiny()
PARTIAL = attrs.evolve(TINY, hidden_size=96, head_dim=48, q_lora_rank=160, moe_intermediate_size=96)
"""Partial edge blocks everywhere: 96/48/64-wide dimensions (one partial block), 160 and 192
(a whole block plus a partial one, which transformers misreads), 128 (one whole block)."""


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    return out


def _written(
    tmp_path: Path, config: DeepseekV4Config, expert_dtype: str, scale_fmt: str, **kwargs: Any
) -> tuple[Path, dict[str, torch.Tensor], QuantizationConfig]:
    directory = save_random_quantized_checkpoint(
        tmp_path / f"{expert_dtype}-{scale_fmt}",
        config,
        seed=7,
        expert_dtype=expert_dtype,
        scale_fmt=scale_fmt,
        **kwargs,
    )
    raw = json.loads((directory / "config.json").read_text())
    qconfig = QuantizationConfig.from_hf_config(raw)
    assert qconfig is not None
    return directory, _tensors(directory), qconfig


def _hf(directory: Path, dtype: torch.dtype) -> transformers.DeepseekV4ForCausalLM:
    loaded: Any = transformers.DeepseekV4ForCausalLM.from_pretrained(
        directory, dtype=dtype, output_loading_info=True
    )
    hf, info = loaded
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    hf.eval()
    return hf


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def test_official_names_invert_canonical_names() -> None:
    names = DeepseekV4ForCausalLM(PARTIAL).state_dict()
    for name in names:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert canonical_name(official_name(name)) == name
    assert official_name("model.layers.1.self_attn.compressor.indexer.kv_norm.weight") == (
        "layers.1.attn.indexer.compressor.norm.weight"
    )


@pytest.mark.parametrize(
    ("expert_dtype", "scale_fmt", "suffix"),
    [
        ("fp4", "ue8m0", ".scale"),
        ("fp4", "float", ".scale"),
        ("fp8", "float", ".scale"),
        ("fp8", "ue8m0", ".weight_scale_inv"),
    ],
)
def test_transformers_loads_the_layout_to_our_dequantization_bit_for_bit(
    tmp_path: Path, expert_dtype: str, scale_fmt: str, suffix: str
) -> None:
    directory, tensors, qconfig = _written(
        tmp_path, TINY, expert_dtype, scale_fmt, scale_suffix=suffix
    )
    scales = pair_scales(tensors)
    # The layout: FP8 linears with scales, experts per format, BF16 unscaled, plain the rest.
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32
    assert tensors[f"layers.0.attn.wq_a{suffix}"].dtype == scale_dtype
    piece = tensors["layers.2.ffn.experts.3.w2.weight"]
    assert piece.dtype == (torch.int8 if expert_dtype == "fp4" else torch.float8_e4m3fn)
    for name in (
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.2.attn.compressor.wgate.weight",
    ):
        assert tensors[name].dtype == torch.bfloat16 and name not in scales
    for name in ("embed.weight", "head.weight", "layers.1.ffn.gate.weight"):
        assert tensors[name].dtype == torch.float32 and name not in scales

    hf = _hf(directory, torch.float32).state_dict()
    ours = dequantize_state_dict(tensors, qconfig, TINY.n_routed_experts)
    assert set(ours) == set(hf)
    for name, value in ours.items():
        assert _same(value, hf[name]), name
    # transformers quirk 2: the BF16-stored unscaled tensors stay BF16 in a float32 load.
    assert {n for n, v in hf.items() if v.dtype == torch.bfloat16} == {
        n for n in hf if BF16_UNSCALED.search(n)
    }


def test_bfloat16_dequantization_equals_transformers_in_bfloat16(tmp_path: Path) -> None:
    directory, tensors, qconfig = _written(tmp_path, TINY, "fp4", "ue8m0")
    hf = _hf(directory, torch.bfloat16).state_dict()
    _, quantized = split_quantized_state(tensors, qconfig, TINY.n_routed_experts)
    for name, value in dequantize_state_dict(
        tensors, qconfig, TINY.n_routed_experts, torch.bfloat16
    ).items():
        if name in quantized:
            assert _same(value, hf[name]), name


def _transformers_reads_right(
    shape: tuple[int, int], grid: tuple[int, int], block: tuple[int, int]
) -> torch.Tensor:
    """Where transformers' ``dim // grid`` block indexing agrees with the ceil grid's."""
    assumed = transformers_block_size(*shape, grid)
    assert assumed is not None, "transformers raises on this shape"
    rows, cols = (torch.arange(n) for n in shape)
    right_rows = rows // assumed[0] == rows // block[0]
    right_cols = cols // assumed[1] == cols // block[1]
    return right_rows[:, None] & right_cols[None, :]


@pytest.mark.parametrize(("expert_dtype", "scale_fmt"), [("fp8", "float"), ("fp4", "ue8m0")])
def test_partial_edge_blocks_equal_transformers_wherever_it_reads_the_grid_right(
    tmp_path: Path, expert_dtype: str, scale_fmt: str
) -> None:
    directory, tensors, qconfig = _written(tmp_path, PARTIAL, expert_dtype, scale_fmt)
    masks: dict[str, torch.Tensor] = {}
    for weight, scale in pair_scales(tensors).items():
        value, grid = tensors[weight], tuple(tensors[scale].shape)
        fp4 = value.dtype == torch.int8
        shape = (value.shape[0], value.shape[1] * (2 if fp4 else 1))
        right = _transformers_reads_right(shape, grid, (1, 32) if fp4 else (128, 128))  # type: ignore[arg-type]
        if EXPERT_PIECE.match(canonical_name(weight)):
            assert bool(right.all()), weight  # expert dims <= one block: read right
        else:
            masks[canonical_name(weight)] = right
    misread = {n for n, m in masks.items() if not bool(m.all())}
    assert misread == {
        n
        for n in masks
        if n.endswith(
            ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "indexer.q_b_proj.weight")
        )
    }
    hf = _hf(directory, torch.float32).state_dict()
    ours = dequantize_state_dict(tensors, qconfig, PARTIAL.n_routed_experts)
    assert set(ours) == set(hf)
    for name, value in ours.items():
        where = masks.get(name)
        if where is None:
            assert _same(value, hf[name]), name
        else:
            assert _same(value[where], hf[name][where]), name


def _weight_only_model(
    tensors: dict[str, torch.Tensor], qconfig: QuantizationConfig, config: DeepseekV4Config
) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(config)
    plain, quantized = split_quantized_state(tensors, qconfig, config.n_routed_experts)
    replaced = install_weight_only(model, quantized, torch.float32)
    assert replaced == set(quantized)
    result = model.load_state_dict(plain, strict=False)
    assert not result.unexpected_keys
    held = {k.rpartition(".")[0] for k in result.missing_keys}
    assert all(
        isinstance(model.get_submodule(m), QuantizedLinear)
        or isinstance(model.get_submodule(m.rpartition(".")[0]), QuantizedExperts)
        for m in held
    )
    return model


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_both_modes_give_identical_logits_close_to_transformers(
    tmp_path: Path, expert_dtype: str
) -> None:
    directory, tensors, qconfig = _written(tmp_path, TINY, expert_dtype, "ue8m0", num_shards=3)
    assert (directory / "model.safetensors.index.json").is_file()
    dequantized = DeepseekV4ForCausalLM(TINY)
    dequantized.load_state_dict(dequantize_state_dict(tensors, qconfig, TINY.n_routed_experts))
    weight_only = _weight_only_model(tensors, qconfig, TINY)
    steps = [[(0, len(PROMPT))]]
    eager = run_schedule(dequantized, [PROMPT], steps)[0]
    assert torch.equal(run_schedule(weight_only, [PROMPT], steps)[0], eager)
    hf = _hf(directory, torch.float32).float()  # quirk 2: cast the BF16-stored tensors
    assert (eager - hf_logits(hf, PROMPT)).abs().max() <= 1e-4


@pytest.mark.parametrize(("expert_dtype", "expert_bytes"), [("fp8", 1.0), ("fp4", 0.5 + 1 / 32)])
def test_weight_only_keeps_the_checkpoint_bytes_resident(
    tmp_path: Path, expert_dtype: str, expert_bytes: float
) -> None:
    """Weight-only holds exactly the checkpoint's quantized bytes and scales: ~1 byte per
    parameter for FP8 (plus one float32/ue8m0 scale per 128×128 block), 0.5 + 1/32 for MXFP4;
    the dequantize mode holds 4 bytes per parameter in float32 (2 in bfloat16)."""
    _, tensors, qconfig = _written(tmp_path, TINY, expert_dtype, "ue8m0")
    scales = pair_scales(tensors)
    stored = sum(tensors[k].nbytes for pair in scales.items() for k in pair)
    weight_only = _weight_only_model(tensors, qconfig, TINY)
    quantized_modules = [
        m for m in weight_only.modules() if isinstance(m, QuantizedLinear | QuantizedExperts)
    ]
    buffers = [(n, b) for m in quantized_modules for n, b in m.named_buffers()]
    held = sum(b.nbytes for n, b in buffers if not n.endswith("fp4_table"))
    tables = sum(b.nbytes for n, b in buffers if n.endswith("fp4_table"))  # 2 KiB per FP4 stack
    assert held == stored
    _, quantized = split_quantized_state(tensors, qconfig, TINY.n_routed_experts)
    experts = [q for n, q in quantized.items() if n.endswith(("gate_up_proj", "down_proj"))]
    per_param = sum(q.nbytes for q in experts) / sum(q.shape.numel() for q in experts)
    assert per_param == pytest.approx(expert_bytes, rel=0.01)
    dequantized = DeepseekV4ForCausalLM(TINY)
    full, light = resident_bytes(dequantized), resident_bytes(weight_only)
    params = sum(q.shape.numel() for q in quantized.values())
    assert full - light == 4 * params - stored - tables
    print(  # measured numbers, reported with -s
        f"\n{expert_dtype} experts: quantized params {params}, checkpoint bytes {stored} "
        f"({stored / params:.4f} B/param) + FP4 tables {tables} B; whole model: weight-only "
        f"{light} B, dequantized fp32 {full} B"
    )
