"""Write the published quantized DeepSeek-V4 layout (REFERENCE §D), as transformers reads it.

``save_quantized_checkpoint`` takes a model (or its state dict, Hugging Face names) and writes:
- ``config.json``: the model config plus ``quantization_config`` (``quant_method: fp8``,
  ``weight_block_size``, ``scale_fmt``, ``expert_dtype``, ``activation_scheme: dynamic``,
  ``fmt: e4m3``);
- safetensors under the official DeepSeek names (``official_name``; no ``model.`` prefix), with
  - FP8 block-quantized linears (``FP8_LINEAR``): ``<stem>.weight`` ``float8_e4m3fn`` plus
    ``<stem>.scale`` (float32, or ``float8_e8m0fnu`` for ``scale_fmt='ue8m0'``);
  - routed experts per expert (``ffn.experts.{e}.w1/w2/w3``): MXFP4 (``int8`` bytes and ue8m0
    scales per 32 inputs) for ``expert_dtype='fp4'``, FP8 blocks for ``'fp8'``;
  - the compressors' and indexer-compressors' ``wkv``/``wgate`` and the indexer's
    ``weights_proj`` (``BF16_UNSCALED``) in bfloat16 without scales;
  - everything else (embed, head, router gate, norms, hyper-connections, sinks, biases, hash
    tables) unchanged, in its own dtype.

Invariant: ``canonical_name(official_name(n)) == n`` for every model tensor name ``n``, and the
directory loads in transformers 5.23.0 (``from_pretrained`` with ``accelerate``; on a CPU it
dequantizes at load) to weights equal, bit for bit in float32, to ``dsv4.quantization``'s
dequantization of the same bytes wherever transformers reads the block grid right (every weight
whose dimensions are at most one block or whole blocks; see ``transformers_block_size``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dsv4.config import DeepseekV4Config
from dsv4.errors import CheckpointError
from dsv4.hf_config import config_to_hf_dict
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.quant_formats import (
    FP4_VALUES,
    FP8_DTYPE,
    FP8_MAX,
    MXFP4_GROUP,
    QuantizationError,
    block_grid,
    expand_block_scale,
    scale_to_float32,
    ue8m0_dtype,
)
from dsv4.quantization import EXPERT_DTYPES, SCALE_FMTS, QuantizationConfig
from dsv4.weights import randomize_

__all__ = [
    "BF16_UNSCALED",
    "FP8_LINEAR",
    "float32_to_ue8m0",
    "official_name",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_state_dict",
    "save_quantized_checkpoint",
    "save_random_quantized_checkpoint",
]

FP8_LINEAR = re.compile(
    r"(\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)"
    r"|\.self_attn\.compressor\.indexer\.q_b_proj"
    r"|\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)
"""Canonical names of the linears the published layout stores as FP8 blocks."""
BF16_UNSCALED = re.compile(
    r"(\.compressor\.(indexer\.)?(kv_proj|gate_proj)|\.compressor\.indexer\.scorer\.weights_proj)"
    r"\.weight$"
)
"""Canonical names the published layout stores in bfloat16 without a scale."""
_ROUTED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")

FP4_MAX = 6.0
"""Largest FP4 (E2M1) magnitude."""

# -- quantizers (the inverse of ``dsv4.quant_formats``'s decoders) ---------------------------


def float32_to_ue8m0(value: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= value`` (positive, finite), as ue8m0 exponent bytes
    (``uint8``, clamped to ``2 ** -127 .. 2 ** 127``); a value of 0 gives ``2 ** 0``."""
    mantissa, exponent = torch.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= m < 1
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(value > 0, ceil_log2, 0)
    return (ceil_log2.clamp(-127, 127) + 127).to(torch.uint8)


def quantize_fp8(
    weight: torch.Tensor, block_size: Sequence[int], scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``dequantize_fp8(q, scale) ≈ weight [..., out, in]``.

    Each block's scale maps its largest magnitude to ``FP8_MAX`` (rounded up to a power of two
    for ``scale_fmt='ue8m0'``, stored as ``float8_e8m0fnu``; else float32); an all-zero block
    gets scale 1. ``q = clamp(weight / scale)`` rounded to nearest ``float8_e4m3fn``.
    """
    w = weight.detach().to(torch.float32).contiguous()  # expert stacks are columns first
    *lead, rows, cols = w.shape
    grid = block_grid(rows, cols, block_size)
    b0, b1 = block_size
    padded = w.new_zeros(*lead, grid[0] * b0, grid[1] * b1)
    padded[..., :rows, :cols] = w
    amax = padded.view(*lead, grid[0], b0, grid[1], b1).abs().amax(dim=(-3, -1))
    scale_f = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    scale: torch.Tensor
    if scale_fmt == "ue8m0":
        scale = float32_to_ue8m0(scale_f).view(ue8m0_dtype())
        scale_f = scale_to_float32(scale)
    elif scale_fmt == "float":
        scale = scale_f
    else:
        raise QuantizationError(f"unknown scale_fmt {scale_fmt!r}; expected 'float' or 'ue8m0'")
    q = (w / expand_block_scale(scale_f, rows, cols, block_size)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed int8 [..., out, in / 2], ue8m0 scale [..., out, in / 32])`` of ``weight``.

    Each group of 32 inputs gets the smallest power-of-two scale that brings its largest
    magnitude to at most 6; each element is rounded to the nearest FP4 value (ties to the
    smaller magnitude). ``in`` must be a multiple of 32.
    """
    w = weight.detach().to(torch.float32).contiguous()  # expert stacks are columns first
    *lead, rows, cols = w.shape
    if cols % MXFP4_GROUP:
        raise QuantizationError(
            f"MXFP4 needs an input size that is a multiple of {MXFP4_GROUP}, got {cols}"
        )
    groups = w.view(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale_bits = float32_to_ue8m0(torch.where(amax > 0, amax / FP4_MAX, 0.0))
    scaled = (groups / scale_to_float32(scale_bits)[..., None]).view(*lead, rows, cols)
    magnitudes = torch.tensor(FP4_VALUES[:8], device=w.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    code = torch.bucketize(scaled.abs(), midpoints)  # index of the nearest magnitude
    code = code | torch.where(scaled < 0, 8, 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale_bits.view(ue8m0_dtype())


# -- names and layout -------------------------------------------------------------------------

_OFFICIAL = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^embed_tokens\.weight$", "embed.weight"),
        (r"^lm_head\.weight$", "head.weight"),
        (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        (r"\.sinks$", ".attn_sink"),
        (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
        (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
        (r"\.compressor\.indexer\.", ".indexer.compressor."),
        (r"\.compressor\.kv_norm\.", ".compressor.norm."),
        (r"\.position_bias$", ".ape"),
        (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
        (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
        (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
        (r"\.q_a_proj\.", ".wq_a."),
        (r"\.q_b_proj\.", ".wq_b."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.gate_proj\.", ".wgate."),
        (r"\.o_a_proj\.", ".wo_a."),
        (r"\.o_b_proj\.", ".wo_b."),
        (r"\.q_a_norm\.", ".q_norm."),
        (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.", ".ffn."),
    )
)


def official_name(name: str) -> str:
    """The official DeepSeek name of a model tensor named the Hugging Face way (the inverse of
    ``dsv4.tensor_names.canonical_name``; routed expert stacks are split by the writer)."""
    bare = name.removeprefix("model.")
    for pattern, replacement in _OFFICIAL:
        bare = pattern.sub(replacement, bare)
    return bare


def quantize_state_dict(
    state: Mapping[str, torch.Tensor],
    config: QuantizationConfig,
    *,
    scale_suffix: str = ".scale",
) -> dict[str, torch.Tensor]:
    """The published layout of a Hugging Face-named state dict: official names, FP8/MXFP4
    weights with scales named ``<stem><scale_suffix>`` (``.scale`` or ``.weight_scale_inv``)."""
    if scale_suffix not in (".scale", ".weight_scale_inv"):
        raise QuantizationError("scale_suffix must be '.scale' or '.weight_scale_inv'")
    out: dict[str, torch.Tensor] = {}

    def put(stem: str, data: torch.Tensor, scale: torch.Tensor) -> None:
        out[f"{stem}.weight"] = data.contiguous()
        out[f"{stem}{scale_suffix}"] = scale.contiguous()

    block = config.weight_block_size
    for name, tensor in state.items():
        value = tensor.detach()
        routed = _ROUTED.match(name)
        if routed is not None:
            stem = official_name(routed["prefix"])
            halves = value.chunk(2, dim=1) if routed["proj"] == "gate_up_proj" else (value,)
            for w, part in zip(("w1", "w3") if len(halves) == 2 else ("w2",), halves, strict=True):
                for e in range(part.shape[0]):
                    if config.expert_dtype == "fp4":
                        put(f"{stem}.{e}.{w}", *quantize_mxfp4(part[e]))
                    else:
                        put(f"{stem}.{e}.{w}", *quantize_fp8(part[e], block, config.scale_fmt))
        elif FP8_LINEAR.search(name):
            put(
                official_name(name).removesuffix(".weight"),
                *quantize_fp8(value, block, config.scale_fmt),
            )
        elif BF16_UNSCALED.search(name):
            out[official_name(name)] = value.to(torch.bfloat16).contiguous()
        else:
            out[official_name(name)] = value.contiguous()
    return out


def _write_shards(tensors: dict[str, torch.Tensor], directory: Path, num_shards: int) -> None:
    names = list(tensors)
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    size = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i * size : (i + 1) * size]}
        save_file(chunk, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save_quantized_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    config: DeepseekV4Config,
    directory: str | Path,
    *,
    expert_dtype: str = "fp4",
    scale_fmt: str = "ue8m0",
    block_size: tuple[int, int] = (128, 128),
    scale_suffix: str = ".scale",
    num_shards: int = 1,
) -> Path:
    """Write ``config.json`` and the published quantized safetensors; return the directory.

    ``model_or_state_dict``: a ``DeepseekV4ForCausalLM`` or its state dict (Hugging Face
    names, float weights). With ``num_shards > 1`` tensors are split in order over that many
    files plus ``model.safetensors.index.json`` (a weight and its scale may land in different
    shards, as they may in published checkpoints). A tied ``lm_head`` is not written.
    """
    if expert_dtype not in EXPERT_DTYPES:
        raise QuantizationError(f"expert_dtype {expert_dtype!r} is not one of {EXPERT_DTYPES}")
    if scale_fmt not in SCALE_FMTS:
        raise QuantizationError(f"scale_fmt {scale_fmt!r} is not one of {SCALE_FMTS}")
    qconfig = QuantizationConfig(
        weight_block_size=block_size, scale_fmt=scale_fmt, expert_dtype=expert_dtype
    )
    if isinstance(model_or_state_dict, nn.Module):
        state = dict(model_or_state_dict.state_dict())
    else:
        state = dict(model_or_state_dict)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = quantize_state_dict(state, qconfig, scale_suffix=scale_suffix)
    directory = Path(directory)
    hf = config_to_hf_dict(config)
    hf["quantization_config"] = qconfig.to_hf_dict()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        _write_shards(tensors, directory, max(1, num_shards))
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint to {directory}: {exc}") from None
    return directory


def save_random_quantized_checkpoint(
    directory: str | Path,
    config: DeepseekV4Config,
    seed: int,
    *,
    expert_dtype: str = "fp4",
    scale_fmt: str = "ue8m0",
    scale_suffix: str = ".scale",
    num_shards: int = 1,
) -> Path:
    """``save_quantized_checkpoint`` of a model with ``dsv4.weights.randomize_`` weights."""
    model = DeepseekV4ForCausalLM(config)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    return save_quantized_checkpoint(
        model,
        config,
        directory,
        expert_dtype=expert_dtype,
        scale_fmt=scale_fmt,
        scale_suffix=scale_suffix,
        num_shards=num_shards,
    )
