"""The published quantized byte formats: decoding by definition, encoding, validation.

Decoders are checked against the definitions of REFERENCE §D written out element-wise
(``w[i, j] = q[i, j] * scale[i // 128, j // 128]``; FP4 element ``2j`` in the low nibble),
on shapes with partial edge blocks and leading (expert) dimensions; quantizers against their
decoders; every malformed pair against a one-line error naming the tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.errors import CheckpointError
from dsv4.quant_formats import (
    FP4_VALUES,
    FP8_MAX,
    QuantizationError,
    QuantizedTensor,
    block_grid,
    dequantize_fp8,
    dequantize_mxfp4,
    scale_to_float32,
    transformers_block_size,
    unpack_fp4,
)
from dsv4.quantization import QuantizationConfig, decode_weight, pair_scales
from dsv4.quantized_writer import float32_to_ue8m0, quantize_fp8, quantize_mxfp4

E8M0 = torch.float8_e8m0fnu


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _random_fp8(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random ``float8_e4m3fn`` bytes covering the finite range (NaN bytes excluded)."""
    raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    raw = torch.where((raw & 0x7F) == 0x7F, 0, raw)  # 0x7F / 0xFF are NaN in e4m3fn
    return raw.view(torch.float8_e4m3fn)


def _fp8_by_definition(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``q[..., i, j] * scale[..., i // b0, j // b1]`` by explicit index arithmetic."""
    rows, cols = q.shape[-2:]
    row_block = torch.arange(rows) // block[0]
    col_block = torch.arange(cols) // block[1]
    s = scale_to_float32(scale).index_select(-2, row_block).index_select(-1, col_block)
    return q.to(torch.float32) * s


def test_ue8m0_bytes_decode_like_torch_float8_e8m0fnu() -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    by_bits = scale_to_float32(every)
    native = every.view(E8M0).to(torch.float32)
    assert torch.equal(_bits(by_bits), _bits(native))
    assert by_bits[127] == 1.0 and by_bits[128] == 2.0 and by_bits[0] == 2.0**-127
    assert torch.isnan(by_bits[255])


def test_float32_to_ue8m0_is_the_smallest_power_of_two_at_least_the_value() -> None:
    values = torch.tensor([1.0, 1.5, 2.0, 0.3, 2.0**-20, 3.0 * 2**30, 0.0])
    decoded = scale_to_float32(float32_to_ue8m0(values))
    assert decoded.tolist() == [1.0, 2.0, 2.0, 0.5, 2.0**-20, 2.0**32, 1.0]


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    experts=st.sampled_from([(), (3,), (2, 2)]),
    block=st.sampled_from([(128, 128), (64, 32), (16, 128)]),
    ue8m0=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp8_blocks_dequantize_by_definition(
    rows: int,
    cols: int,
    experts: tuple[int, ...],
    block: tuple[int, int],
    ue8m0: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    q = _random_fp8((*experts, rows, cols), generator)
    grid = (*experts, *block_grid(rows, cols, block))
    if ue8m0:
        scale = torch.randint(100, 150, grid, generator=generator).to(torch.uint8).view(E8M0)
    else:
        scale = torch.rand(grid, generator=generator) + 0.01
    expected = _fp8_by_definition(q, scale, block)
    assert torch.equal(_bits(dequantize_fp8(q, scale, block)), _bits(expected))
    raw = dequantize_fp8(q.view(torch.uint8), scale.view(torch.uint8) if ue8m0 else scale, block)
    assert torch.equal(_bits(raw), _bits(expected))
    bf16 = dequantize_fp8(q, scale, block, torch.bfloat16)
    assert torch.equal(bf16, expected.to(torch.bfloat16))


def test_fp4_nibbles_low_first_and_the_code_table() -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(1, 256)
    values = unpack_fp4(every)[0].view(256, 2)
    table = torch.tensor(FP4_VALUES)
    assert torch.equal(values[:, 0], table.repeat(16))  # low nibble: element 2j
    assert torch.equal(values[:, 1], table.repeat_interleave(16))  # high nibble: 2j + 1
    assert torch.equal(torch.signbit(values[8, :1]), torch.tensor([True]))  # code 8 is -0


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 5),
    experts=st.sampled_from([(), (3,)]),
    seed=st.integers(0, 2**16),
)
def test_mxfp4_dequantizes_by_definition(
    rows: int, groups: int, experts: tuple[int, ...], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    cols = 32 * groups
    codes = torch.randint(0, 16, (*experts, rows, cols), generator=generator)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.randint(110, 140, (*experts, rows, groups), generator=generator).to(torch.uint8)
    table = torch.tensor(FP4_VALUES)
    expected = table[codes] * scale_to_float32(scale).repeat_interleave(32, dim=-1)
    got = dequantize_mxfp4(packed, scale.view(E8M0))
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_quantizer_round_trips_within_fp8_precision(scale_fmt: str) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 150, generator=generator) * torch.logspace(-3, 2, 150)
    q, scale = quantize_fp8(weight, (128, 128), scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    assert scale.dtype == (E8M0 if scale_fmt == "ue8m0" else torch.float32)
    back = dequantize_fp8(q, scale, (128, 128))
    block_max = _fp8_by_definition(torch.ones_like(weight), scale, (128, 128)) * FP8_MAX
    assert bool(((back - weight).abs() <= block_max * 2**-4).all())  # e4m3: 3 mantissa bits
    # A dequantized weight re-quantizes to the same values.
    q2, scale2 = quantize_fp8(back, (128, 128), scale_fmt)
    assert torch.equal(dequantize_fp8(q2, scale2, (128, 128)), back)


def test_mxfp4_quantizer_is_nearest_and_idempotent_on_its_values() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(7, 3, 64, generator=generator) * 3
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (7, 3, 32)
    assert scale.dtype == E8M0 and scale.shape == (7, 3, 2)
    back = dequantize_mxfp4(packed, scale)
    s = scale_to_float32(scale).repeat_interleave(32, dim=-1)
    grid = torch.tensor(FP4_VALUES[:8])
    nearest = (weight.abs() / s).unsqueeze(-1).sub(grid).abs().min(dim=-1).values
    assert torch.equal((back.abs() / s - weight.abs() / s).abs(), nearest)
    packed2, scale2 = quantize_mxfp4(back)
    assert torch.equal(dequantize_mxfp4(packed2, scale2), back)


def test_transformers_block_size_quirk_only_where_partial_blocks_exceed_one_block() -> None:
    assert transformers_block_size(96, 64, (1, 1)) == (96, 64)  # one partial block: right
    assert transformers_block_size(256, 384, (2, 3)) == (128, 128)  # whole blocks: right
    assert transformers_block_size(192, 128, (2, 1)) == (96, 128)  # 96-row blocks: wrong
    assert transformers_block_size(129, 128, (2, 1)) is None  # transformers raises


# -- validation -------------------------------------------------------------------------------

CONFIG = QuantizationConfig(expert_dtype="fp4", scale_fmt="ue8m0")


def _message(excinfo: pytest.ExceptionInfo[QuantizationError]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    assert isinstance(excinfo.value, CheckpointError)
    return text


def test_fp8_scale_off_the_ceil_grid_is_refused_naming_the_tensor() -> None:
    q = torch.zeros(192, 96, dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantizationError) as excinfo:
        decode_weight("layers.0.attn.wq_a.weight", q, torch.ones(1, 1), CONFIG, routed_expert=False)
    text = _message(excinfo)
    assert "layers.0.attn.wq_a.weight" in text and "[2, 1]" in text


def test_quantized_weight_without_scale_is_refused() -> None:
    q = torch.zeros(8, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantizationError, match=r"'w\.weight' has no scale"):
        decode_weight("w.weight", q, None, CONFIG, routed_expert=False)
    packed = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(QuantizationError, match=r"'e\.weight' has no scale"):
        decode_weight("e.weight", packed, None, CONFIG, routed_expert=True)


def test_formats_other_than_the_configs_are_refused() -> None:
    packed = torch.zeros(8, 16, dtype=torch.int8)
    scale = torch.zeros(8, 1, dtype=torch.uint8).view(E8M0)
    fp8_config = QuantizationConfig(expert_dtype="fp8")
    with pytest.raises(QuantizationError, match="expert_dtype is 'fp8'"):
        decode_weight("e.weight", packed, scale, fp8_config, routed_expert=True)
    with pytest.raises(QuantizationError, match="not a routed expert"):
        decode_weight("w.weight", packed, scale, CONFIG, routed_expert=False)
    q = torch.zeros(8, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantizationError, match="expert_dtype is 'fp4'"):
        decode_weight("e.weight", q, torch.ones(1, 1), CONFIG, routed_expert=True)
    with pytest.raises(QuantizationError, match=r"has a scale but is torch\.float32"):
        decode_weight("w.weight", torch.zeros(8, 8), torch.ones(1, 1), CONFIG, routed_expert=False)
    with pytest.raises(QuantizationError, match=r"scale of FP4 tensor 'e\.weight' has shape"):
        decode_weight("e.weight", packed, scale[:, :0], CONFIG, routed_expert=True)


def test_plain_weights_decode_to_none() -> None:
    assert decode_weight("w.weight", torch.zeros(3, 3), None, CONFIG, routed_expert=False) is None
    table = torch.zeros(4, 2, dtype=torch.int64)
    assert decode_weight("t", table, None, CONFIG, routed_expert=False) is None


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "expert_dtype": "fp6"}, "expert_dtype 'fp6' is not supported"),
        ({"quant_method": "fp8", "scale_fmt": "e5m2"}, "scale_fmt 'e5m2' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be"),
    ],
)
def test_bad_quantization_configs_are_refused_naming_the_field(
    section: dict[str, object], match: str
) -> None:
    with pytest.raises(QuantizationError, match=match):
        QuantizationConfig.from_hf_config({"quantization_config": section})


def test_quantization_config_reads_transformers_defaults_and_top_level_expert_dtype() -> None:
    assert QuantizationConfig.from_hf_config({}) is None
    config = QuantizationConfig.from_hf_config(
        {"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    )
    assert config == QuantizationConfig(expert_dtype="fp4")
    inner = {"quant_method": "fp8", "expert_dtype": "fp8", "scale_fmt": "ue8m0"}
    config = QuantizationConfig.from_hf_config(
        {"expert_dtype": "fp4", "quantization_config": inner}
    )
    assert config is not None and config.expert_dtype == "fp8" and config.scale_fmt == "ue8m0"
    assert QuantizationConfig.from_hf_config({"quantization_config": config.to_hf_dict()}) == config


def test_scales_pair_with_their_weights_in_either_spelling() -> None:
    keys = [
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.q_b_proj.weight_scale_inv",
        "model.layers.0.attn_hc.scale",  # a parameter, not a scale
        "layers.0.hc_attn_scale",
    ]
    assert pair_scales(keys) == {
        "layers.0.attn.wq_a.weight": "layers.0.attn.wq_a.scale",
        "model.layers.0.self_attn.q_b_proj.weight": (
            "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
        ),
    }
    with pytest.raises(QuantizationError, match="two scales"):
        pair_scales(["a.weight", "a.scale", "a.weight_scale_inv"])


def test_stacking_quantized_tensors_of_different_shapes_is_refused() -> None:
    a = QuantizedTensor.fp8(
        "a", torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128)
    )
    b = QuantizedTensor.fp8(
        "b", torch.zeros(5, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128)
    )
    with pytest.raises(QuantizationError, match="'x' differ"):
        QuantizedTensor.stack("x", [a, b])
