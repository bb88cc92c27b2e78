"""``load_checkpoint`` on the published quantized layout (``dsv4.quantized_loading``).

Both modes load the weights ``dsv4.quantization`` dequantizes from the same bytes (which
``test_quantized_checkpoint`` proves equal to transformers'): dequantize fills the plain
parameters with them, weight-only swaps in modules holding the bytes, and the two run to
bit-identical logits, in float32 and bfloat16, with partial edge blocks, float32 or ue8m0
scales, either scale spelling, and weights and scales in different shards. Weight-only keeps
the checkpoint's bytes resident. Bad inputs are refused with one line naming the tensor and file.
The CLI side (``dsv4 run`` against transformers in every graph mode) is
``tests/cli/test_quantized_run.py``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.checkpoint import TensorValueError, load_checkpoint, save_random_checkpoint
from dsv4.config import DeepseekV4Config
from dsv4.errors import CheckpointError
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.quant_layers import (
    QuantizedExperts,
    QuantizedGroupedLinear,
    QuantizedLinear,
    resident_bytes,
)
from dsv4.quantization import QuantizationConfig, QuantizationError, dequantize_state_dict
from dsv4.quantized_writer import quantize_fp8, save_random_quantized_checkpoint
from dsv4.testing import run_schedule

PROMPT = list(range(1, 38))
TINY = DeepseekV4Config.tiny()
PARTIAL = attrs.evolve(TINY, hidden_size=96, head_dim=48, q_lora_rank=160, moe_intermediate_size=96)
"""Partial edge blocks: 96/48-wide dimensions, and 160/192 (a whole block plus a partial one)."""
Edit = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    return out


def _logits(model: DeepseekV4ForCausalLM) -> torch.Tensor:
    return run_schedule(model, [PROMPT], [[(0, len(PROMPT))]])[0]


def _reference(directory: Path, config: DeepseekV4Config, dtype: torch.dtype) -> torch.Tensor:
    """Logits of a plain model holding ``dequantize_state_dict`` of the checkpoint's bytes."""
    raw = json.loads((directory / "config.json").read_text())
    qconfig = QuantizationConfig.from_hf_config(raw)
    assert qconfig is not None
    state = dequantize_state_dict(_tensors(directory), qconfig, config.n_routed_experts, dtype)
    model = DeepseekV4ForCausalLM(config, dtype=dtype)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()})
    return _logits(model)


@pytest.mark.parametrize(
    ("config", "expert_dtype", "scale_fmt", "suffix", "shards", "dtype"),
    [
        (TINY, "fp4", "ue8m0", ".scale", 1, torch.float32),
        (TINY, "fp8", "float", ".weight_scale_inv", 3, torch.float32),
        (PARTIAL, "fp8", "ue8m0", ".scale", 2, torch.float32),
        (TINY, "fp4", "ue8m0", ".weight_scale_inv", 2, torch.bfloat16),
    ],
    ids=["fp4-ue8m0", "fp8-float-sharded", "partial-blocks", "fp4-bfloat16"],
)
def test_both_modes_load_the_dequantized_weights_and_give_identical_logits(
    tmp_path: Path,
    config: DeepseekV4Config,
    expert_dtype: str,
    scale_fmt: str,
    suffix: str,
    shards: int,
    dtype: torch.dtype,
) -> None:
    directory = save_random_quantized_checkpoint(
        tmp_path,
        config,
        seed=4,
        expert_dtype=expert_dtype,
        scale_fmt=scale_fmt,
        scale_suffix=suffix,
        num_shards=shards,
    )
    expected = _reference(directory, config, dtype)
    dequantized = load_checkpoint(directory, dtype=dtype, quantization="dequantize")
    assert not any(isinstance(m, QuantizedLinear | QuantizedExperts) for m in dequantized.modules())
    assert torch.equal(_logits(dequantized), expected)
    for mode in ("weight-only", "auto"):
        weight_only = load_checkpoint(directory, dtype=dtype, quantization=mode)
        layer = weight_only.model.layers[1]
        assert isinstance(layer.self_attn.q_a_proj, QuantizedLinear)
        assert isinstance(layer.self_attn.o_a_proj, QuantizedGroupedLinear)
        assert isinstance(layer.self_attn.o_b_proj, QuantizedLinear)
        assert isinstance(layer.mlp.shared_experts.down_proj, QuantizedLinear)
        assert isinstance(layer.mlp.experts, QuantizedExperts)
        assert not isinstance(layer.self_attn.compressor.kv_proj, QuantizedLinear)  # BF16 stored
        assert torch.equal(_logits(weight_only), expected)


def test_weight_only_dequantizes_a_quantized_tensor_of_any_other_module(
    fp4_checkpoint: Path, tmp_path: Path
) -> None:
    """The published layout quantizes linears and experts only; a quantized router gate (not
    an ``nn.Linear``) is dequantized into its parameter in weight-only mode too."""
    name = "layers.1.ffn.gate.weight"

    def quantize_gate(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        tensors[name], tensors["layers.1.ffn.gate.scale"] = quantize_fp8(tensors[name], (128, 128))

    directory = _rewrite(fp4_checkpoint, tmp_path / "gate", quantize_gate)
    weight_only = load_checkpoint(directory, quantization="weight-only")
    dequantized = load_checkpoint(directory, quantization="dequantize")
    gate = weight_only.model.layers[1].mlp.gate.weight
    assert gate.dtype == torch.float32
    assert torch.equal(gate, dequantized.model.layers[1].mlp.gate.weight)
    assert torch.equal(_logits(weight_only), _logits(dequantized))


def test_weight_only_holds_about_the_checkpoint_size(tmp_path: Path) -> None:
    """Resident bytes of a weight-only model: the checkpoint's own bytes, plus the BF16-stored
    tensors widened to the float32 model and 2 KiB of FP4 decode tables per expert stack."""
    for expert_dtype in ("fp4", "fp8"):
        directory = save_random_quantized_checkpoint(
            tmp_path / expert_dtype, TINY, seed=1, expert_dtype=expert_dtype
        )
        stored = sum(t.nbytes for t in _tensors(directory).values())
        on_disk = (directory / "model.safetensors").stat().st_size
        light = resident_bytes(load_checkpoint(directory, quantization="weight-only"))
        full = resident_bytes(load_checkpoint(directory, quantization="dequantize"))
        print(  # the measured figures, shown with -s
            f"\n{expert_dtype} experts: checkpoint {on_disk} B on disk ({stored} B of tensors); "
            f"resident weight-only {light} B ({light / stored:.3f}x), dequantized fp32 {full} B "
            f"({full / stored:.2f}x)"
        )
        assert stored <= light <= 1.10 * stored
        assert full >= 2.2 * stored


def test_a_plain_checkpoint_ignores_the_mode(tmp_path: Path) -> None:
    save_random_checkpoint(tmp_path, TINY, seed=2)
    expected = _logits(load_checkpoint(tmp_path))
    for mode in ("weight-only", "dequantize"):
        model = load_checkpoint(tmp_path, quantization=mode)
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        assert torch.equal(_logits(model), expected)
    with pytest.raises(CheckpointError, match=r"^quantization 'int4' is not one of auto, "):
        load_checkpoint(tmp_path, quantization="int4")


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fp4")
    return save_random_quantized_checkpoint(directory, TINY, seed=3, expert_dtype="fp4")


def _rewrite(source: Path, target: Path, edit: Edit) -> Path:
    """Copy a one-file checkpoint, letting ``edit`` change its tensors and config dict."""
    shutil.copytree(source, target)
    tensors = _tensors(target)
    raw = json.loads((target / "config.json").read_text())
    edit(tensors, raw)
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(raw))
    return target


def test_mtp_tensors_are_skipped(fp4_checkpoint: Path, tmp_path: Path) -> None:
    def add_mtp(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
        tensors["mtp.0.attn.wq_a.scale"] = torch.ones(9, 9)  # off its grid: never read
        tensors["mtp.0.ffn.experts.0.w1.weight"] = torch.zeros(4, 4, dtype=torch.int8)

    directory = _rewrite(fp4_checkpoint, tmp_path / "mtp", add_mtp)
    assert torch.equal(
        _logits(load_checkpoint(directory)), _logits(load_checkpoint(fp4_checkpoint))
    )


def _drop(*names: str) -> Edit:
    def edit(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        for name in names:
            del tensors[name]

    return edit


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
    def edit(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        tensors[name] = value(tensors[name])

    return edit


def _plain(stem: str) -> Edit:
    """A plain float piece in place of a quantized one (its scale dropped)."""

    def edit(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        del tensors[f"{stem}.scale"]
        tensors[f"{stem}.weight"] = torch.zeros(64, 128)

    return edit


def _config(**fields: Any) -> Edit:
    def edit(tensors: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
        raw["quantization_config"].update(fields)

    return edit


def _nan_code(t: torch.Tensor) -> torch.Tensor:
    raw = t.view(torch.uint8).clone()
    raw[3, 5] = 0x7F
    return raw.view(torch.float8_e4m3fn)


def _nan_scale(t: torch.Tensor) -> torch.Tensor:
    raw = t.view(torch.uint8).clone()
    raw[0, 0] = 255
    return raw.view(t.dtype)


FP8_HINT = "(expected '<weight>.scale' or '<weight>.weight_scale_inv')"
BAD: list[tuple[str, Edit, type[Exception], str]] = [
    (
        "scale off the block grid",
        _set("layers.0.attn.wq_a.scale", lambda t: t.expand(2, 1).contiguous()),
        QuantizationError,
        "scale of FP8 tensor 'layers.0.attn.wq_a.weight' has shape [2, 1], expected [1, 1] for a "
        "weight of shape [64, 128] with [128, 128] blocks (ceil grid) (in model.safetensors)",
    ),
    (
        "FP4 scale off its groups",
        _set("layers.1.ffn.experts.2.w2.scale", lambda t: t[:, :1].contiguous()),
        QuantizationError,
        "scale of FP4 tensor 'layers.1.ffn.experts.2.w2.weight' has shape [128, 1], expected "
        "[128, 2] for a weight of shape [128, 32] with one scale per 32 inputs (in "
        "model.safetensors)",
    ),
    (
        "weight without its scale",
        _drop("layers.2.attn.wo_b.scale"),
        QuantizationError,
        f"FP8 tensor 'layers.2.attn.wo_b.weight' has no scale {FP8_HINT} (in model.safetensors)",
    ),
    (
        "scale without its weight",
        _drop("layers.0.ffn.shared_experts.w3.weight"),
        QuantizationError,
        "tensor 'layers.0.ffn.shared_experts.w3.scale' in model.safetensors is a scale without a "
        "weight (no 'layers.0.ffn.shared_experts.w3.weight' in the checkpoint)",
    ),
    (
        "unknown quant_method",
        _config(quant_method="int4"),
        QuantizationError,
        "config.json quantization_config: quant_method 'int4' is not supported (supported: 'fp8')",
    ),
    (
        "unknown expert_dtype",
        _config(expert_dtype="fp6"),
        QuantizationError,
        "config.json quantization_config: expert_dtype 'fp6' is not supported (supported: "
        "'fp8', 'fp4')",
    ),
    (
        "FP4 experts under expert_dtype fp8",
        _config(expert_dtype="fp8"),
        QuantizationError,
        "tensor 'layers.0.ffn.experts.0.w1.weight' is packed FP4 (torch.int8) but is a routed "
        "expert and quantization_config.expert_dtype is 'fp8' (in model.safetensors)",
    ),
    (
        "quantized and plain expert pieces",
        _plain("layers.1.ffn.experts.3.w3"),
        QuantizationError,
        "routed experts 'model.layers.1.mlp.experts' mix quantized and plain pieces: "
        "'layers.1.ffn.experts.3.w3.weight' is not quantized",
    ),
    (
        "missing expert piece",
        _drop("layers.2.ffn.experts.3.w1.weight", "layers.2.ffn.experts.3.w1.scale"),
        CheckpointError,
        "checkpoint {directory} is missing tensor 'model.layers.2.mlp.experts.3.w1.weight'",
    ),
    (
        "weight and scale of the wrong shape for the model",
        _set("layers.0.attn.wq_b.weight", lambda t: t[:100].contiguous()),
        CheckpointError,
        "tensor 'layers.0.attn.wq_b.weight' in model.safetensors dequantizes to shape "
        "[100, 64], expected [128, 64]",
    ),
    (
        "FP8 NaN code",
        _set("layers.1.attn.wkv.weight", _nan_code),
        TensorValueError,
        "tensor 'layers.1.attn.wkv.weight' in model.safetensors has NaN codes: 1 of 4096, the "
        "first at index [3, 5]; the weights are corrupt",
    ),
    (
        "NaN ue8m0 scale",
        _set("layers.0.ffn.experts.1.w2.scale", _nan_scale),
        TensorValueError,
        "tensor 'layers.0.ffn.experts.1.w2.scale' in model.safetensors has non-finite scales "
        "(NaN or inf): 1 of 256, the first nan at index [0, 0]; the weights are corrupt",
    ),
]


@pytest.mark.parametrize("mode", ["weight-only", "dequantize"])
@pytest.mark.parametrize(
    ("edit", "error", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_quantized_checkpoints_give_one_line_errors(
    fp4_checkpoint: Path,
    tmp_path: Path,
    mode: str,
    edit: Edit,
    error: type[Exception],
    message: str,
) -> None:
    directory = _rewrite(fp4_checkpoint, tmp_path / "bad", edit)
    with pytest.raises(error) as raised:
        load_checkpoint(directory, quantization=mode)
    assert str(raised.value) == message.format(directory=directory)


def test_a_quantized_tensor_overflowing_the_compute_dtype_is_refused(
    fp4_checkpoint: Path, tmp_path: Path
) -> None:
    edit = _set("layers.0.attn.wq_a.scale", lambda t: torch.full(t.shape, 2.0**20))
    directory = _rewrite(fp4_checkpoint, tmp_path / "big", edit)
    load_checkpoint(directory, quantization="dequantize")  # fine in float32
    for mode in ("weight-only", "dequantize"):
        with pytest.raises(TensorValueError, match=r"overflow float16: \d+ of 8192, the first"):
            load_checkpoint(directory, dtype=torch.float16, quantization=mode)
