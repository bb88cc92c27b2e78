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
   (which may sit in another shard) through the load's ``ShardReader``, decodes and validates
   the pair (``decode_weight``: scale grid, missing scale, format vs ``expert_dtype``), checks
   its shape against the model's and its values (``dsv4.quantized_values``: NaN codes,
   non-finite scales, overflow of the compute dtype), then by mode:
   - ``weight-only``: copies the bytes and scales out of the mapped file into memory of their
     own, block by block (an expert piece straight into its slot of a stack allocated once per
     layer), and installs ``dsv4.quant_layers`` modules holding them, computing in the replaced
     parameter's dtype; a quantized tensor of any other module (never the case in the
     published layout) is dequantized into its parameter instead;
   - ``dequantize``: dequantizes into the parameter block by block (``dequantize_into``: the
     float32 product of a block of rows, cast once by the copy; routed experts piece by piece
     into their slice of the stack).
   It returns the names it filled; ``load_checkpoint`` fills the others.

Tensor parallelism (``share``, a ``dsv4.sharding.RankShare``): a split weight is validated
against the full model's shape, then only the rank's part is taken (``QuantizedTensor.narrow``:
views of the memory-mapped bytes and scales, so only those pages are read; a part that does not
fit the scale blocks is refused on one line); of the routed experts only the rank's pieces are
read, into stacks of the rank's experts.

Invariants: every failure is a ``CheckpointError`` (``QuantizationError`` for the layout,
``TensorValueError`` for values) on one line naming the tensor as the file names it and the
file; ``load_checkpoint`` returns a model only when every tensor was filled. No temporary is
larger than a block of ``max_values`` values (or one tensor's quantized bytes, mapped);
``mtp.*`` is skipped. ``auto`` is ``weight-only`` for a quantized checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import attrs
import torch
from torch import nn

from dsv4.errors import CheckpointError
from dsv4.hf_config import CONFIG_FILE
from dsv4.layers import GroupedLinear
from dsv4.load_progress import LoadTally
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
)
from dsv4.quantized_values import Pair, check_values, dequantize_into
from dsv4.shard_reader import Entry, ShardReader, Stored
from dsv4.sharding import RankShare, Split, split_dim
from dsv4.tensor_names import canonical_name

__all__ = ["LOAD_MODES", "QuantizedPlan", "Stored", "load_quantized", "plan_quantized"]

LOAD_MODES = ("auto", *QUANTIZATION_MODES)
"""``load_checkpoint(quantization=...)``: ``auto`` is ``weight-only`` for a quantized checkpoint."""
_SKIPPED = re.compile(r"(^|\.)mtp\.")
_QUANTIZED_DTYPES = ("F8", "F6", "F4", "I8", "U8")
"""Safetensors dtype prefixes of quantized bytes."""
_PIECE_SLOTS = ("w1", "w3", "w2")
_STACK_PARTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""Each expert stack's parts, in row order: ``gate_up_proj`` is ``w1`` rows then ``w3`` rows."""


@attrs.frozen(kw_only=True)
class QuantizedPlan:
    """What ``load_quantized`` will read (see the module docstring)."""

    config: QuantizationConfig
    mode: QuantizationMode
    share: RankShare
    """What the loading rank holds (the whole model for one rank)."""
    weights: Mapping[str, Pair]
    """Canonical model tensor name -> its quantized weight and scale."""
    experts: Mapping[str, Mapping[tuple[int, str], Pair]]
    """``...mlp.experts`` prefix -> ``(expert, "w1"|"w2"|"w3")`` -> piece and scale."""
    claimed: frozenset[str]

    @property
    def provides(self) -> frozenset[str]:
        stacks = (f"{p}.{s}" for p in self.experts for s in _STACK_PARTS)
        return frozenset((*self.weights, *stacks))

    def read_bytes(self, entries: Mapping[Stored, Entry]) -> dict[Stored, int]:
        """Every weight and scale the plan reads, with the stored bytes it reads of each (a
        split weight's part, only the rank's experts' pieces)."""
        parts = self.share.parallel.size
        local = self.share.experts
        sizes: dict[Stored, int] = {}
        for name, pair in self.weights.items():
            split = split_dim(name) is not None and parts > 1
            for stored in pair:
                if stored is not None:
                    sizes[stored] = entries[stored].nbytes // (parts if split else 1)
        for found in self.experts.values():
            for (e, _), pair in found.items():
                if e in local:
                    sizes.update({s: entries[s].nbytes for s in pair if s is not None})
        return sizes


def _raw_config(directory: Path) -> Any:
    try:
        return json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / CONFIG_FILE}: {exc}") from None


def plan_quantized(
    directory: Path,
    entries: Iterable[Entry],
    targets: Mapping[str, torch.Tensor],
    *,
    mode: str,
    share: RankShare,
    tied: bool,
) -> QuantizedPlan | None:
    """The plan for a quantized checkpoint, ``None`` for a plain one (see the module
    docstring); ``entries`` are the checkpoint's stored tensors, ``targets`` the tensors of
    ``share``'s model, ``mode`` one of ``LOAD_MODES``."""
    num_experts = share.config.n_routed_experts
    if mode not in LOAD_MODES:
        raise CheckpointError(f"quantization {mode!r} is not one of {', '.join(LOAD_MODES)}")
    config = QuantizationConfig.from_hf_config(_raw_config(directory))
    if config is None:
        return None
    kept = [e for e in entries if not _SKIPPED.search(e.stored.key)]
    where = {e.stored.key: e.stored.path for e in kept}
    dtypes = {e.stored.key: e.dtype for e in kept}
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
        share=share,
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
    model: nn.Module,
    plan: QuantizedPlan,
    targets: Mapping[str, torch.Tensor],
    reader: ShardReader,
    tally: LoadTally,
    *,
    max_values: int,
) -> set[str]:
    """Fill (or, weight-only, replace) every tensor ``plan`` provides, reading through
    ``reader`` in blocks of at most ``max_values`` values and reporting each stored tensor to
    ``tally``; return the names filled."""
    weight_only = plan.mode == "weight-only"
    share = plan.share
    local = share.experts
    resident: dict[torch.dtype, dict[str, QuantizedTensor]] = {}
    for name, pair in plan.weights.items():
        target = targets[name]
        split = share.split(name, target.shape)
        full = share.full_shape(name, target.shape)
        qt = _share_of(_decode(reader, pair, plan.config, full, routed=False), split, pair)
        if weight_only and _installable(model, name):
            check_values(qt, target.dtype, pair, max_values=max_values)
            resident.setdefault(target.dtype, {})[name] = _owned(qt, target.device, max_values)
        else:
            dequantize_into(qt, target, pair, max_values=max_values)
        _report(tally, pair)
    for prefix, found in plan.experts.items():
        gate_up, down = targets[f"{prefix}.gate_up_proj"], targets[f"{prefix}.down_proj"]
        half = gate_up.shape[1] // 2
        slots = {"w1": gate_up[:, :half], "w3": gate_up[:, half:], "w2": down}
        stacks = {
            stack: _ExpertStack(f"{prefix}.{stack}", parts, len(local), gate_up.device)
            for stack, parts in _STACK_PARTS.items()
        }
        for (e, w), pair in sorted(found.items()):
            if e not in local:
                continue
            slot = slots[w][e - local.start]
            qt = _decode(reader, pair, plan.config, slot.shape, routed=True)
            if weight_only:
                check_values(qt, slot.dtype, pair, max_values=max_values)
                stack = stacks["down_proj" if w == "w2" else "gate_up_proj"]
                stack.put(e - local.start, w, qt, max_values)
            else:
                dequantize_into(qt, slot, pair, max_values=max_values)
            _report(tally, pair)
        if weight_only:
            group = resident.setdefault(gate_up.dtype, {})
            group.update({stack.name: stack.result() for stack in stacks.values()})
    for dtype, group in resident.items():
        install_weight_only(model, group, dtype)
    return set(plan.provides)


def _share_of(qt: QuantizedTensor, split: Split | None, pair: Pair) -> QuantizedTensor:
    """The rank's ``split`` part of ``qt`` (all of it for ``None``)."""
    if split is None:
        return qt
    weight = pair[0]
    try:
        return qt.narrow(weight.key, split.dim, split.start, split.stop)
    except QuantizationError as exc:
        raise QuantizationError(f"{exc} (in {weight.path.name})") from None


def _report(tally: LoadTally, pair: Pair) -> None:
    for stored in pair:
        if stored is not None:
            tally.done(stored)


def _owned(qt: QuantizedTensor, device: torch.device, max_values: int) -> QuantizedTensor:
    """``qt`` (viewing the mapped file) copied, block by block, into memory of its own."""
    data = torch.empty(qt.data.shape, dtype=qt.data.dtype, device=device)
    scale = torch.empty(qt.scale.shape, dtype=qt.scale.dtype, device=device)
    owned = QuantizedTensor(qt.format, data, scale, qt.block_size)
    _copy_blocks(qt, owned, max_values)
    return owned


def _copy_blocks(source: QuantizedTensor, target: QuantizedTensor, max_values: int) -> None:
    pairs = zip(source.chunks(max_values), target.chunks(max_values), strict=True)
    for (_, src), (_, dst) in pairs:
        dst.data.copy_(src.data)
        dst.scale.copy_(src.scale)


class _ExpertStack:
    """One quantized expert stack (``[E, P, out, in']`` bytes and ``[E, P, ...]`` scales, the
    layout ``QuantizedExpertStack`` takes), allocated once at its first piece and filled piece
    by piece; every piece must match the first in format, dtypes and shapes."""

    def __init__(self, name: str, parts: tuple[str, ...], num_experts: int, device: torch.device):
        self.name = name
        self.parts = parts
        self.num_experts = num_experts
        self.device = device
        self._stack: QuantizedTensor | None = None

    def put(self, expert: int, part: str, qt: QuantizedTensor, max_values: int) -> None:
        """Copy piece ``(expert, part)`` into its slot."""
        if self._stack is None:
            lead = (self.num_experts, len(self.parts))
            data = torch.empty(lead + qt.data.shape, dtype=qt.data.dtype, device=self.device)
            scale = torch.empty(lead + qt.scale.shape, dtype=qt.scale.dtype, device=self.device)
            self._stack = QuantizedTensor(qt.format, data, scale, qt.block_size)
        stack = self._stack
        if (qt.format, qt.block_size, qt.data.dtype, qt.scale.dtype) != (
            stack.format,
            stack.block_size,
            stack.data.dtype,
            stack.scale.dtype,
        ) or (qt.data.shape, qt.scale.shape) != (stack.data.shape[2:], stack.scale.shape[2:]):
            raise QuantizationError(
                f"quantized tensors stacked into {self.name!r} differ in format, dtype or shape"
            )
        p = self.parts.index(part)
        slot = QuantizedTensor(
            stack.format, stack.data[expert, p], stack.scale[expert, p], stack.block_size
        )
        _copy_blocks(qt, slot, max_values)

    def result(self) -> QuantizedTensor:
        """The filled stack (the plan guarantees every piece was put)."""
        assert self._stack is not None
        return self._stack


def _installable(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the weight of a module ``install_weight_only`` can replace."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    plain_linear = isinstance(module, nn.Linear) and module.bias is None
    return leaf == "weight" and (plain_linear or isinstance(module, GroupedLinear))


def _decode(
    reader: ShardReader,
    pair: Pair,
    config: QuantizationConfig,
    expected: torch.Size | tuple[int, ...],
    *,
    routed: bool,
) -> QuantizedTensor:
    """The validated pair, viewing the mapped file (nothing is read until its blocks are)."""
    weight, scale = pair
    data = reader.read(weight)
    try:
        qt = decode_weight(
            weight.key,
            data,
            None if scale is None else reader.read(scale),
            config,
            routed_expert=routed,
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
