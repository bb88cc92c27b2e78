"""The published quantized checkpoint layout: config, tensor pairing, and the two load modes.

A quantized DeepSeek-V4 checkpoint (REFERENCE §D) declares ``quantization_config`` in
``config.json`` (``QuantizationConfig.from_hf_config``) and stores some weights as quantized
bytes plus a scale named ``<stem>.scale`` or ``<stem>.weight_scale_inv`` next to
``<stem>.weight`` (``pair_scales``). A weight *with* a scale is quantized, whatever its module;
its bytes decide the format (``decode_weight``): ``float8_e4m3fn`` is FP8 blocks of
``weight_block_size``; ``int8`` is MXFP4 and only allowed for routed experts when
``expert_dtype`` is ``fp4``.

Two modes (``QUANTIZATION_MODES``), with bit-identical weights:
- ``dequantize``: every quantized tensor is expanded to the compute dtype at load
  (``QuantizedTensor.dequantize``; whole state dicts: ``dequantize_state_dict``);
- ``weight-only``: the bytes stay resident and the modules dequantize inside each matmul
  (``install_weight_only`` swaps ``dsv4.quant_layers`` modules into a built model).

Routed experts arrive as per-expert pieces ``...mlp.experts.{e}.w{1,2,3}.weight`` (canonical
names); ``stack_expert_pieces`` turns them into the model's ``gate_up_proj`` (``w1`` rows then
``w3`` rows) and ``down_proj`` (``w2``) stacks, quantized or plain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import torch

from dsv4.quant_formats import FP8_DTYPE, QuantizationError, QuantizedTensor
from dsv4.quant_layers import install_weight_only
from dsv4.tensor_names import canonical_name

__all__ = [
    "EXPERT_DTYPES",
    "EXPERT_PIECE",
    "QUANTIZATION_MODES",
    "QUANT_METHODS",
    "SCALE_FMTS",
    "SCALE_SUFFIXES",
    "QuantizationConfig",
    "QuantizationError",
    "QuantizationMode",
    "QuantizedTensor",
    "decode_weight",
    "dequantize_stack",
    "dequantize_state_dict",
    "install_weight_only",
    "pair_scales",
    "split_quantized_state",
    "stack_expert_pieces",
]

QuantizationMode = Literal["weight-only", "dequantize"]
QUANTIZATION_MODES: tuple[QuantizationMode, ...] = ("weight-only", "dequantize")
QUANT_METHODS = ("fp8",)
EXPERT_DTYPES = ("fp8", "fp4")
SCALE_FMTS = ("float", "ue8m0")
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
"""How a scale is named: ``<stem>.scale`` (the V4-Flash spelling) or ``<stem>.weight_scale_inv``
next to its weight ``<stem>.weight``; both mean the same."""
EXPERT_PIECE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$")
"""A routed expert's piece, canonical name (``w1`` gate, ``w2`` down, ``w3`` up)."""


def _problem(field: str, value: Any, allowed: Iterable[str]) -> QuantizationError:
    choices = ", ".join(repr(a) for a in allowed)
    return QuantizationError(
        f"config.json quantization_config: {field} {value!r} is not supported "
        f"(supported: {choices})"
    )


@attrs.frozen(kw_only=True)
class QuantizationConfig:
    """``quantization_config`` of a quantized checkpoint, validated (defaults: transformers')."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> QuantizationConfig | None:
        """Read ``config.json``'s ``quantization_config`` (``None`` when the checkpoint is not
        quantized); a top-level ``expert_dtype`` is folded in as transformers does. Unknown
        ``quant_method``/``expert_dtype``/``scale_fmt``, a static activation scheme or a bad
        block size raise ``QuantizationError`` naming the field."""
        section = raw.get("quantization_config")
        if section is None:
            return None
        if not isinstance(section, Mapping):
            raise QuantizationError(
                f"config.json quantization_config must be an object, got {section!r}"
            )
        method = section.get("quant_method")
        if method not in QUANT_METHODS:
            raise _problem("quant_method", method, QUANT_METHODS)
        expert_dtype = section.get("expert_dtype", raw.get("expert_dtype", "fp8"))
        if expert_dtype not in EXPERT_DTYPES:
            raise _problem("expert_dtype", expert_dtype, EXPERT_DTYPES)
        scale_fmt = section.get("scale_fmt", "float")
        if scale_fmt not in SCALE_FMTS:
            raise _problem("scale_fmt", scale_fmt, SCALE_FMTS)
        scheme = str(section.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise _problem("activation_scheme", scheme, ("dynamic",))
        block = section.get("weight_block_size", (128, 128))
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise QuantizationError(
                "config.json quantization_config: weight_block_size must be two positive "
                f"integers, got {block!r}"
            )
        skip = section.get("modules_to_not_convert") or ()
        return cls(
            quant_method=method,
            weight_block_size=(block[0], block[1]),
            scale_fmt=scale_fmt,
            expert_dtype=expert_dtype,
            activation_scheme=scheme,
            modules_to_not_convert=tuple(str(s) for s in skip),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of ``config.json`` (``fmt`` is informative)."""
        out: dict[str, Any] = {
            "quant_method": self.quant_method,
            "weight_block_size": list(self.weight_block_size),
            "scale_fmt": self.scale_fmt,
            "expert_dtype": self.expert_dtype,
            "activation_scheme": self.activation_scheme,
            "fmt": "e4m3",
        }
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out


def pair_scales(keys: Iterable[str]) -> dict[str, str]:
    """``{weight key: scale key}`` for every ``<stem>.weight`` stored with ``<stem>.scale`` or
    ``<stem>.weight_scale_inv`` (checkpoint keys, any naming). A key with a scale suffix but no
    such weight is not paired (``attn_hc.scale`` is a parameter); a weight with both spellings
    raises ``QuantizationError``."""
    present = set(keys)
    pairs: dict[str, str] = {}
    for key in sorted(present):
        for suffix in SCALE_SUFFIXES:
            if key.endswith(suffix):
                weight = key[: -len(suffix)] + ".weight"
                if weight not in present:
                    continue
                if weight in pairs:
                    raise QuantizationError(
                        f"tensor {weight!r} has two scales, {pairs[weight]!r} and {key!r}"
                    )
                pairs[weight] = key
    return pairs


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in (FP8_DTYPE, torch.int8, torch.uint8) or str(dtype).startswith(
        ("torch.float8", "torch.float4")
    )


def decode_weight(
    name: str,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    config: QuantizationConfig,
    *,
    routed_expert: bool,
) -> QuantizedTensor | None:
    """The ``QuantizedTensor`` of checkpoint weight ``name``, or ``None`` for a plain (float,
    unscaled) one. ``routed_expert``: ``name`` is a routed expert piece (``EXPERT_PIECE`` on its
    canonical name), the only place MXFP4 may appear, and only with ``expert_dtype: fp4``.

    Raises ``QuantizationError`` naming ``name`` for: quantized bytes without a scale, a scale on
    a float weight, a format other than the config's, a scale off its weight's grid.
    """
    if scale is None and not _is_quantized_dtype(data.dtype):
        return None
    if scale is not None and not _is_quantized_dtype(data.dtype):
        raise QuantizationError(
            f"tensor {name!r} has a scale but is {data.dtype}, not a quantized dtype"
        )
    if data.dtype in (torch.int8, torch.uint8):
        if not routed_expert or config.expert_dtype != "fp4":
            where = "a routed expert" if routed_expert else "not a routed expert"
            raise QuantizationError(
                f"tensor {name!r} is packed FP4 ({data.dtype}) but is {where} and "
                f"quantization_config.expert_dtype is {config.expert_dtype!r}"
            )
        return QuantizedTensor.mxfp4(name, data, scale)
    if data.dtype == FP8_DTYPE and routed_expert and config.expert_dtype != "fp8":
        raise QuantizationError(
            f"routed expert tensor {name!r} is float8_e4m3fn but "
            f"quantization_config.expert_dtype is {config.expert_dtype!r} (packed int8 expected)"
        )
    return QuantizedTensor.fp8(name, data, scale, config.weight_block_size)


def stack_expert_pieces(
    prefix: str,
    pieces: Mapping[tuple[int, str], torch.Tensor | QuantizedTensor],
    num_experts: int,
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """``{prefix.gate_up_proj, prefix.down_proj}`` from ``pieces[(e, "w1"|"w2"|"w3")]``.

    Plain pieces give the model's stacks (``[E, 2I, hidden]``, ``[E, hidden, I]``); quantized
    ones give ``QuantizedTensor`` stacks ``[E, 2, I, hidden']`` and ``[E, 1, hidden, I']`` (for
    ``QuantizedExpertStack``, or ``dequantize_stack``). Mixing the two, or a missing piece, raises
    ``QuantizationError``.
    """
    order = (("w1", "w3"), ("w2",))
    for e in range(num_experts):
        for w in ("w1", "w2", "w3"):
            if (e, w) not in pieces:
                raise QuantizationError(f"checkpoint is missing tensor '{prefix}.{e}.{w}.weight'")
    kinds = {isinstance(p, QuantizedTensor) for p in pieces.values()}
    if len(kinds) > 1:
        raise QuantizationError(f"routed experts of {prefix!r} mix quantized and plain pieces")
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for target, parts in zip(("gate_up_proj", "down_proj"), order, strict=True):
        name = f"{prefix}.{target}"
        chosen = [[pieces[(e, w)] for w in parts] for e in range(num_experts)]
        if kinds == {True}:
            stacks = [
                QuantizedTensor.stack(name, [p for p in row if isinstance(p, QuantizedTensor)])
                for row in chosen
            ]
            out[name] = QuantizedTensor.stack(name, stacks)
        else:
            rows = [torch.cat([p for p in row if isinstance(p, torch.Tensor)]) for row in chosen]
            out[name] = torch.stack(rows)
    return out


def dequantize_stack(quantized: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``QuantizedTensor`` dequantized to its model shape (expert stacks ``[E, P, out, in]``
    become ``[E, P*out, in]``)."""
    values = quantized.dequantize(dtype)
    return values.flatten(1, 2) if values.dim() == 4 else values


def split_quantized_state(
    tensors: Mapping[str, torch.Tensor],
    config: QuantizationConfig,
    num_experts: int,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedTensor]]:
    """An in-memory checkpoint (any naming) as canonical ``(plain, quantized)`` tensors.

    Scales are consumed by their weights; ``mtp.*`` is skipped; routed expert pieces are stacked
    (``stack_expert_pieces``). The reference for what a lazy loader does tensor by tensor.
    """
    scales = pair_scales(tensors)
    scale_keys = set(scales.values())
    plain: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    pieces: dict[str, dict[tuple[int, str], torch.Tensor | QuantizedTensor]] = {}
    for key, value in tensors.items():
        if key in scale_keys or re.search(r"(^|\.)mtp\.", key):
            continue
        name = canonical_name(key)
        piece = EXPERT_PIECE.match(name)
        scale = tensors[scales[key]] if key in scales else None
        decoded = decode_weight(key, value, scale, config, routed_expert=piece is not None)
        if piece is not None:
            found = pieces.setdefault(piece["prefix"], {})
            found[(int(piece["expert"]), piece["w"])] = value if decoded is None else decoded
        elif decoded is None:
            plain[name] = value
        else:
            quantized[name] = decoded
    for prefix, found in pieces.items():
        for name, stacked in stack_expert_pieces(prefix, found, num_experts).items():
            if isinstance(stacked, QuantizedTensor):
                quantized[name] = stacked
            else:
                plain[name] = stacked
    return plain, quantized


def dequantize_state_dict(
    tensors: Mapping[str, torch.Tensor],
    config: QuantizationConfig,
    num_experts: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The *dequantize* mode over an in-memory checkpoint: canonical names, quantized tensors
    expanded to ``dtype``, plain tensors unchanged (``split_quantized_state``)."""
    plain, quantized = split_quantized_state(tensors, config, num_experts)
    return {**plain, **{k: dequantize_stack(q, dtype) for k, q in quantized.items()}}
