"""Loading the published quantized layout (REFERENCE §D): the quantized half of
``dsv4.checkpoint.load_checkpoint``, which calls this module at two points.

1. ``plan_quantized`` (before any tensor is read, from ``config.json`` and the safetensors
   headers only): ``None`` when ``config.json`` declares no ``quantization_config`` (a plain
   checkpoint: nothing to do, whatever the mode). Otherwise a ``QuantizedPlan`` naming the
   checkpoint keys this module owns (``claimed``: each weight stored with a ``.scale`` /
   ``.weight_scale_inv``, or stored as ``F8_*``/``I8``/``U8``, plus those scales; the plain
   reader skips them) and the model tensors they fill (``provides``; routed expert pieces
   ``ffn.experts.{e}.w{1,2,3}`` fill their layer's ``gate_up_proj``/``down_proj``). It raises
   for a scale without its weight, a quantized tensor the model has no place for, routed
   experts mixing quantized and plain pieces, or a missing expert piece.
2. ``load_quantized`` (after the plain reader's checks): reads each weight with its scale
   (which may sit in another shard; one handle per file, each tensor read once), decodes and
   validates the pair (``decode_weight``: scale grid, missing scale, format vs
   ``expert_dtype``), checks its shape against the model's and its values
   (``dsv4.quantized_values``: NaN codes, non-finite scales, overflow of the compute dtype),
   then by mode:
   - ``weight-only``: installs ``dsv4.quant_layers`` modules holding the bytes, computing in
     the replaced parameter's dtype; a quantized tensor of any other module (never the case
     in the published layout) is dequantized into its parameter instead;
   - ``dequantize``: dequantizes into the parameter (float32 product, one cast; routed
     experts piece by piece into their slice of the stack, so one piece is transient).
   It returns the names it filled; ``load_checkpoint`` fills the others.

Invariants: every failure is a ``CheckpointError`` (``QuantizationError`` for the layout,
``TensorValueError`` for values) on one line naming the tensor as the file names it and the
file; ``load_checkpoint`` returns a model only when every tensor was filled. ``mtp.*`` is
skipped. ``auto`` is ``weight-only`` for a quantized checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import attrs
import torch
from safetensors import safe_open
from torch import nn

from dsv4.checkpoint import canonical_name
from dsv4.errors import CheckpointError
from dsv4.hf_config import CONFIG_FILE
from dsv4.layers import GroupedLinear
from dsv4.quant_formats import QuantizedTensor
from dsv4.quantization import (
    EXPERT_PIECE,
    QUANTIZATION_MODES,
    SCALE_SUFFIXES,
    QuantizationConfig,
    QuantizationError,
    QuantizationMode,
    decode_weight,
    install_weight_only,
    pair_scales,
    stack_expert_pieces,
)
from dsv4.quantized_values import Pair, Stored, check_values, dequantized

__all__ = ["LOAD_MODES", "QuantizedPlan", "Stored", "load_quantized", "plan_quantized"]

LOAD_MODES = ("auto", *QUANTIZATION_MODES)
"""``load_checkpoint(quantization=...)``: ``auto`` is ``weight-only`` for a quantized checkpoint."""
_SKIPPED = re.compile(r"(^|\.)mtp\.")
_QUANTIZED_DTYPES = ("F8", "F6", "F4", "I8", "U8")
"""Safetensors dtype prefixes of quantized bytes."""
_PIECE_SLOTS = ("w1", "w3", "w2")


@attrs.frozen(kw_only=True)
class QuantizedPlan:
    """What ``load_quantized`` will read (see the module docstring)."""

    config: QuantizationConfig
    mode: QuantizationMode
    num_experts: int
    weights: Mapping[str, Pair]
    """Canonical model tensor name -> its quantized weight and scale."""
    experts: Mapping[str, Mapping[tuple[int, str], Pair]]
    """``...mlp.experts`` prefix -> ``(expert, "w1"|"w2"|"w3")`` -> piece and scale."""
    claimed: frozenset[str]

    @property
    def provides(self) -> frozenset[str]:
        stacks = (f"{p}.{s}" for p in self.experts for s in ("gate_up_proj", "down_proj"))
        return frozenset((*self.weights, *stacks))


def _raw_config(directory: Path) -> Any:
    try:
        return json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / CONFIG_FILE}: {exc}") from None


def _header_dtypes(where: Mapping[str, Path]) -> dict[str, str]:
    """Each key's safetensors dtype (``F8_E4M3`` ...), from the headers only."""
    dtypes: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for key, path in where.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            dtypes.update((key, handle.get_slice(key).get_dtype()) for key in keys)
    return dtypes


def plan_quantized(
    directory: Path,
    entries: Iterable[tuple[Path, str]],
    targets: Mapping[str, torch.Tensor],
    *,
    mode: str,
    num_experts: int,
    tied: bool,
) -> QuantizedPlan | None:
    """The plan for a quantized checkpoint, ``None`` for a plain one (see the module
    docstring); ``mode`` is one of ``LOAD_MODES``."""
    if mode not in LOAD_MODES:
        raise CheckpointError(f"quantization {mode!r} is not one of {', '.join(LOAD_MODES)}")
    config = QuantizationConfig.from_hf_config(_raw_config(directory))
    if config is None:
        return None
    where = {key: path for path, key in entries if not _SKIPPED.search(key)}
    dtypes = _header_dtypes(where)
    scales = pair_scales(where)
    scale_keys = set(scales.values())
    weights: dict[str, Pair] = {}
    experts: dict[str, dict[tuple[int, str], Pair]] = {}
    plain_pieces: dict[tuple[str, int, str], str] = {}
    claimed: set[str] = set()
    for key, path in where.items():
        name = canonical_name(key)
        if key.endswith(SCALE_SUFFIXES) and key not in scale_keys and name not in targets:
            stem = re.sub(r"(\.scale|\.weight_scale_inv)$", "", key)
            raise QuantizationError(
                f"tensor {key!r} in {path.name} is a scale without a weight "
                f"(no '{stem}.weight' in the checkpoint)"
            )
        if key in scale_keys:
            continue
        piece = EXPERT_PIECE.match(name)
        quantized = key in scales or dtypes[key].startswith(_QUANTIZED_DTYPES)
        if not quantized or (name in targets and not targets[name].is_floating_point()):
            if piece is not None:
                plain_pieces[(piece["prefix"], int(piece["expert"]), piece["w"])] = key
            continue  # the plain reader's
        scale = Stored(where[scales[key]], scales[key]) if key in scales else None
        claimed.add(key)
        if scale is not None:
            claimed.add(scale.key)
        if piece is not None:
            found = experts.setdefault(piece["prefix"], {})
            found[(int(piece["expert"]), piece["w"])] = (Stored(path, key), scale)
        elif name in targets:
            weights[name] = (Stored(path, key), scale)
        elif not (name == "lm_head.weight" and tied):
            raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
    for prefix, found in experts.items():
        _check_pieces(directory, prefix, found, targets, num_experts, plain_pieces)
    chosen = cast(QuantizationMode, "weight-only" if mode == "auto" else mode)
    return QuantizedPlan(
        config=config,
        mode=chosen,
        num_experts=num_experts,
        weights=weights,
        experts=experts,
        claimed=frozenset(claimed),
    )


def _check_pieces(
    directory: Path,
    prefix: str,
    found: Mapping[tuple[int, str], Pair],
    targets: Mapping[str, torch.Tensor],
    num_experts: int,
    plain_pieces: Mapping[tuple[str, int, str], str],
) -> None:
    """Every piece of ``prefix``'s experts present and quantized, and none beyond them."""
    extra = [pair for (e, _), pair in found.items() if e >= num_experts]
    if f"{prefix}.gate_up_proj" not in targets or extra:
        stored = (extra or list(found.values()))[0][0]
        raise CheckpointError(f"unexpected tensor {stored.key!r} in {stored.path.name}")
    for e in range(num_experts):
        for w in _PIECE_SLOTS:
            if (e, w) in found:
                continue
            plain = plain_pieces.get((prefix, e, w))
            if plain is not None:
                raise QuantizationError(
                    f"routed experts {prefix!r} mix quantized and plain pieces: {plain!r} is "
                    "not quantized"
                )
            raise CheckpointError(
                f"checkpoint {directory} is missing tensor '{prefix}.{e}.{w}.weight'"
            )


# -- reading, checking, filling ----------------------------------------------------------------


def load_quantized(
    model: nn.Module, plan: QuantizedPlan, targets: Mapping[str, torch.Tensor]
) -> set[str]:
    """Fill (or, weight-only, replace) every tensor ``plan`` provides; return their names."""
    weight_only = plan.mode == "weight-only"
    resident: dict[torch.dtype, dict[str, QuantizedTensor]] = {}
    with contextlib.ExitStack() as files:
        handles: dict[Path, Any] = {}

        def read(stored: Stored) -> torch.Tensor:
            if stored.path not in handles:
                opened = safe_open(str(stored.path), framework="pt")
                handles[stored.path] = files.enter_context(opened)
            return handles[stored.path].get_tensor(stored.key)

        for name, pair in plan.weights.items():
            target = targets[name]
            qt = _decode(read, pair, plan.config, target.shape, routed=False)
            if weight_only and _installable(model, name):
                check_values(qt, target.dtype, pair)
                resident.setdefault(target.dtype, {})[name] = qt
            else:
                target.copy_(dequantized(qt, target.dtype, pair))
        for prefix, found in plan.experts.items():
            gate_up, down = targets[f"{prefix}.gate_up_proj"], targets[f"{prefix}.down_proj"]
            half = gate_up.shape[1] // 2
            slots = {"w1": gate_up[:, :half], "w3": gate_up[:, half:], "w2": down}
            pieces: dict[tuple[int, str], torch.Tensor | QuantizedTensor] = {}
            for (e, w), pair in sorted(found.items()):
                slot = slots[w][e]
                qt = _decode(read, pair, plan.config, slot.shape, routed=True)
                if weight_only:
                    check_values(qt, slot.dtype, pair)
                    pieces[(e, w)] = qt
                else:
                    slot.copy_(dequantized(qt, slot.dtype, pair))
            if weight_only:
                stacks = stack_expert_pieces(prefix, pieces, plan.num_experts)
                group = resident.setdefault(gate_up.dtype, {})
                group.update({n: s for n, s in stacks.items() if isinstance(s, QuantizedTensor)})
    for dtype, group in resident.items():
        install_weight_only(model, group, dtype)
    return set(plan.provides)


def _installable(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the weight of a module ``install_weight_only`` can replace."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    plain_linear = isinstance(module, nn.Linear) and module.bias is None
    return leaf == "weight" and (plain_linear or isinstance(module, GroupedLinear))


def _decode(
    read: Callable[[Stored], torch.Tensor],
    pair: Pair,
    config: QuantizationConfig,
    expected: torch.Size,
    *,
    routed: bool,
) -> QuantizedTensor:
    weight, scale = pair
    data = read(weight)
    try:
        qt = decode_weight(
            weight.key, data, None if scale is None else read(scale), config, routed_expert=routed
        )
    except QuantizationError as exc:
        raise QuantizationError(f"{exc} (in {weight.path.name})") from None
    if qt is None:  # not reached: the plan claims quantized or scaled tensors only
        raise QuantizationError(f"tensor {weight.key!r} in {weight.path.name} is not quantized")
    if tuple(qt.shape) != tuple(expected):
        raise CheckpointError(
            f"tensor {weight.key!r} in {weight.path.name} dequantizes to shape "
            f"{list(qt.shape)}, expected {list(expected)}"
        )
    return qt
