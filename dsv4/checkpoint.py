"""Checkpoints: ``config.json`` plus ``*.safetensors`` in the Hugging Face layout.

Tensor names may be the Hugging Face names (what ``save_random_checkpoint`` writes), the
official DeepSeek names (``layers.0.attn.wq_a.weight``, per-expert ``ffn.experts.{e}.w1/w2/w3``,
``hc_attn_fn`` ...) or the mix ``transformers`` itself writes on ``save_pretrained`` (official
sub-names under a ``model.`` prefix); all are mapped to one canonical (Hugging Face) name.
Multi-token-prediction tensors (``mtp.*``) are skipped, as the reference does.

Loading is strict: a missing, unexpected or mis-shaped tensor or an unreadable file (a truncated
one named as truncated) raises ``CheckpointError`` naming the tensor and file; the model is only
returned when every parameter and persistent buffer was filled. The published quantized layout
(``config.json`` with a ``quantization_config``: FP8 block linears, MXFP4 or FP8 experts) is read
by ``dsv4.quantized_loading`` (weight-only or dequantized, ``quantization=``); quantized bytes or
scales in a checkpoint without that config are refused. Values are checked too, since a bad one
would otherwise surface as garbage tokens (NaN weights decode to token 0) or as an indexing
failure deep inside a graph capture: ``TensorValueError`` names the tensor, the file, the first
bad value and what was expected when a floating tensor holds NaN or inf once in the model's
dtype, or a hash-routing table ``tid2eid`` holds an expert id outside ``0 .. n_routed_experts-1``.

Memory: the model is built uninitialised in its final dtypes and filled in place; tensors are
read lazily from the memory-mapped shards (``dsv4.shard_reader``) in blocks of ``chunk_budget``
bytes, each block cast by its copy into the parameter and checked finite there, so a load's peak
is the model plus a few blocks (the error path alone reads a whole tensor, to report it).

Tensor parallelism (``parallel=``): the model is rank ``parallel``'s share (``dsv4.model``) and
each stored tensor is checked against the *full* model's shape but only the rank's slice of it
is read (``dsv4.sharding.RankShare``: safetensors ``get_slice`` of the rank's rows or columns;
of routed experts stored one per tensor, only the rank's experts); quantized tensors likewise
(``dsv4.quantized_loading``), sliced at scale-block boundaries.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable, Iterable
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file

from dsv4.config import DeepseekV4Config
from dsv4.dtypes import dtype_name
from dsv4.errors import CheckpointError, TensorValueError
from dsv4.hf_config import load_config, save_config
from dsv4.load_progress import LoadTally, ProgressOption
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.parallel import SINGLE, TensorParallel
from dsv4.quantized_loading import load_quantized, plan_quantized
from dsv4.shard_reader import Entry, ShardReader, Stored, element_bits, index_chunks
from dsv4.sharding import RankShare, Split
from dsv4.tensor_names import canonical_name
from dsv4.weights import randomize_

__all__ = [
    "TensorValueError",
    "canonical_name",
    "chunk_budget",
    "load_checkpoint",
    "save_random_checkpoint",
]

_EXPERT_PIECE = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$"
)
_SKIPPED = re.compile(r"(^|\.)mtp\.")
_QUANT_SCALE = re.compile(r"(\.scale|_scale_inv|\.scale_inv)$")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_INT_DTYPES = {"I16", "I32", "I64", "U16", "U32"}
_HASH_TABLE = ".mlp.gate.tid2eid"
"""Canonical-name suffix of a hash layer's token-to-expert table."""
_CHUNK_FRACTION = 128
_MIN_CHUNK = 2**20
_MAX_CHUNK = 64 * 2**20
_DEQUANTIZE_BYTES = 16
"""Bytes of temporaries per value a block of dequantization holds (codes unpacked to float32,
their scales, the float32 product), so such a block stays within the chunk budget."""


INDEX_FILE = "model.safetensors.index.json"


def _shards(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those ``model.safetensors.index.json`` names (each
    must exist) when there is one, else every ``*.safetensors`` of the directory."""
    index = directory / INDEX_FILE
    if not index.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in checkpoint directory {directory}")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {INDEX_FILE} in {directory}: {exc}") from None
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(
                f"shard {name!r} named by {INDEX_FILE} is missing from {directory}"
            )
    return [directory / name for name in names]


def chunk_budget(model_bytes: int) -> int:
    """Bytes one step of a load may hold besides the model: ``model_bytes / 128``, between
    1 MiB and 64 MiB (bounds the blocks read and converted and the mapped file pages)."""
    return min(max(model_bytes // _CHUNK_FRACTION, _MIN_CHUNK), _MAX_CHUNK)


def _check_header(entry: Entry, expected: torch.Tensor, split: Split | None, parts: int) -> None:
    """The stored dtype must suit the model's (floating for floating, integer for integer) and
    the stored shape must be the full model's: ``expected``'s, its ``split`` dimension ``parts``
    times as long."""
    key, file = entry.stored.key, entry.stored.path.name
    allowed = _FLOAT_DTYPES if expected.is_floating_point() else _INT_DTYPES
    if entry.dtype not in allowed:
        quantized = entry.dtype.startswith(("F8", "F4", "F6", "U8", "I8"))
        why = " (quantized, but config.json has no quantization_config)" if quantized else ""
        raise CheckpointError(
            f"tensor {key!r} in {file} is {entry.dtype}{why}; expected one of {sorted(allowed)}"
        )
    shape = list(expected.shape)
    if split is not None:
        shape[split.dim] *= parts
    if list(entry.shape) != shape:
        raise CheckpointError(
            f"tensor {key!r} in {file} has shape {list(entry.shape)}, expected {shape}"
        )


@attrs.frozen(eq=False)
class _Fill:
    """One stored tensor filling ``target`` (a parameter or a slice of one): all of it, or the
    ``split`` part of it (a tensor-parallel rank's share)."""

    target: torch.Tensor
    entry: Entry
    split: Split | None = None


def _fill(reader: ShardReader, fill: _Fill, budget: int, parts: int) -> None:
    """Copy ``fill``'s stored tensor (its ``split`` part, read alone) into its target in blocks
    of at most ``budget`` bytes, each cast by the copy and checked finite in the target's dtype;
    the stored shape must be the full model's (``parts`` parts of a split dimension)."""
    entry, target, split = fill.entry, fill.target, fill.split
    _check_header(entry, target, split, parts)
    element = max(element_bits(entry.dtype) / 8, target.element_size())
    for index in index_chunks(target.shape, element, budget):
        part = target[index]
        stored = index if split is None else split.stored_index(index, target.dim())
        part.copy_(reader.read(entry.stored, stored))
        if part.is_floating_point() and not bool(torch.isfinite(part).all()):
            raise _value_error(reader.read(entry.stored), entry.stored, target.dtype)


def _value_error(stored: torch.Tensor, where: Stored, dtype: torch.dtype) -> TensorValueError:
    """What is wrong with ``stored``, a tensor holding NaN or inf once cast to ``dtype``."""
    value = stored.to(dtype)
    bad = ~torch.isfinite(value)
    first = bad.nonzero()[0].tolist()
    count = f"{int(bad.sum())} of {value.numel()}"
    was = stored[tuple(first)].item()
    if math.isfinite(was):
        reason = (
            f"has values that overflow {dtype_name(dtype)}: {count}, the first {was:g} at index "
            f"{first}; load it in float32 or bfloat16"
        )
    else:
        reason = (
            f"has non-finite values (NaN or inf): {count}, the first {was} at index {first}; "
            "the weights are corrupt"
        )
    return TensorValueError(where.key, where.path.name, reason)


def _check_expert_ids(table: torch.Tensor, where: Stored, num_experts: int) -> None:
    """Every entry of a hash-routing table must name one of the ``num_experts`` experts."""
    bad = (table < 0) | (table >= num_experts)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise TensorValueError(
            where.key,
            where.path.name,
            f"holds expert id {int(table[tuple(first)])} at index {first} (token {first[0]}); "
            f"expert ids must be in 0..{num_experts - 1} (n_routed_experts={num_experts})",
        )


Fills = dict[str, list[_Fill]]
"""Model tensor name -> the stored tensors filling it."""


def _expert_fills(
    directory: Path,
    pieces: dict[str, dict[tuple[int, str], Entry]],
    targets: dict[str, torch.Tensor],
    num_experts: int,
    local: range,
) -> Fills:
    """Official per-expert ``w1``/``w3`` (gate, up) and ``w2`` (down) pieces, each filling its
    slice of the HF stacks ``gate_up_proj`` (``w1`` rows then ``w3`` rows) and ``down_proj``;
    every expert's pieces must be stored, those of the ``local`` experts (the rank's, the first
    at index 0 of its stacks) are read."""
    fills: Fills = {}
    for prefix, found in pieces.items():
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        extra = [entry for (e, _), entry in found.items() if e >= num_experts]
        if gate_up not in targets or extra:
            stored = (extra or list(found.values()))[0].stored
            raise CheckpointError(f"unexpected tensor {stored.key!r} in {stored.path.name}")
        for e in range(num_experts):
            for w in ("w1", "w2", "w3"):
                if (e, w) not in found:
                    raise CheckpointError(
                        f"checkpoint {directory} is missing tensor '{prefix}.{e}.{w}.weight'"
                    )
        half = targets[gate_up].shape[1] // 2
        fills[gate_up] = [
            _Fill(targets[gate_up][e - local.start, rows], found[(e, w)])
            for e in local
            for w, rows in (("w1", slice(None, half)), ("w3", slice(half, None)))
        ]
        fills[down] = [_Fill(targets[down][e - local.start], found[(e, "w2")]) for e in local]
    return fills


def _plain_fills(
    directory: Path,
    entries: Iterable[Entry],
    targets: dict[str, torch.Tensor],
    share: RankShare,
    claimed: frozenset[str],
    provided: frozenset[str],
) -> Fills:
    """What fills each model tensor (the rank's ``share``) the quantized loader does not (it
    reads the ``claimed`` keys and fills the ``provided`` tensors); raises for an unexpected
    tensor, a scale without a quantization config, or a missing tensor."""
    config = share.config
    fills: Fills = {}
    pieces: dict[str, dict[tuple[int, str], Entry]] = {}
    for entry in entries:
        path, key = entry.stored.path, entry.stored.key
        if _SKIPPED.search(key) or key in claimed:
            continue
        name = canonical_name(key)
        piece = _EXPERT_PIECE.match(name)
        if piece is not None:
            pieces.setdefault(piece["prefix"], {})[(int(piece["expert"]), piece["w"])] = entry
        elif name in targets:
            target = targets[name]
            fills[name] = [_Fill(target, entry, share.split(name, target.shape))]
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        elif _QUANT_SCALE.search(key):
            raise CheckpointError(
                f"tensor {key!r} in {path.name} is a quantization scale, but config.json has no "
                "quantization_config"
            )
        else:
            raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
    fills.update(_expert_fills(directory, pieces, targets, config.n_routed_experts, share.experts))
    missing = [name for name in targets if name not in fills and name not in provided]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {directory} is missing tensor {missing[0]!r}{more}")
    return fills


def load_checkpoint(
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "auto",
    progress: ProgressOption = "terminal",
    parallel: TensorParallel = SINGLE,
) -> DeepseekV4ForCausalLM:
    """Build the model described by ``directory/config.json`` (rank ``parallel``'s share of it)
    and fill it from its safetensors, reading only that share.

    ``dtype`` is the compute dtype (``dsv4.dtypes``: the fp32-kept parameters stay float32).
    The parameters are allocated once, uninitialised, in their final dtypes; each stored tensor
    is read from the memory-mapped file in blocks (``chunk_budget`` of the model's bytes), each
    block cast by its copy into the parameter and checked there, so besides the model a load
    holds about one block and the file pages of a few (never a float32 copy of the model, nor a
    whole converted tensor).

    ``quantization`` (``auto``, ``weight-only``, ``dequantize``) is how a quantized checkpoint
    loads (``dsv4.quantized_loading``; ``auto`` is weight-only); a plain one ignores it.
    ``progress`` receives ``dsv4.load_progress.LoadProgress`` reports: ``"terminal"`` (the
    default) draws a bar on stderr when stderr is a terminal and nothing otherwise, ``None``
    reports nothing. ``parallel``: the tensor-parallel rank whose share is built and read
    (``dsv4.sharding``; the stored tensors are the full model's); a size that does not split
    the model raises ``dsv4.parallel.ParallelSizeError``, a quantized part that does not fit its
    scale blocks ``QuantizationError``, each on one line."""
    directory = Path(directory)
    config = load_config(directory)
    model = DeepseekV4ForCausalLM(
        config, device=device, dtype=dtype, initialize=False, parallel=parallel
    )
    share = RankShare(config, parallel)
    targets = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        targets.pop("lm_head.weight")
    budget = chunk_budget(sum(t.numel() * t.element_size() for t in targets.values()))
    with ShardReader(_shards(directory), budget=budget) as reader:
        entries = list(reader.entries.values())
        plan = plan_quantized(
            directory,
            entries,
            targets,
            mode=quantization,
            share=share,
            tied=config.tie_word_embeddings,
        )
        claimed, provided = (plan.claimed, plan.provides) if plan else (frozenset(), frozenset())
        fills = _plain_fills(directory, entries, targets, share, claimed, provided)
        sizes: dict[Hashable, int] = {
            f.entry.stored: _read_bytes(f, parallel.size) for p in fills.values() for f in p
        }
        for stored, size in (plan.read_bytes(reader.entries) if plan else {}).items():
            sizes[stored] = size
        tally = LoadTally(sizes, progress)
        try:
            with torch.no_grad():
                filled: set[str] = set()
                if plan is not None:
                    values = max(1, budget // _DEQUANTIZE_BYTES)
                    filled = load_quantized(model, plan, targets, reader, tally, max_values=values)
                for name, target in targets.items():
                    if name in filled:
                        continue
                    for fill in fills[name]:
                        _fill(reader, fill, budget, parallel.size)
                        tally.done(fill.entry.stored)
                    if name.endswith(_HASH_TABLE):
                        stored = fills[name][0].entry.stored
                        _check_expert_ids(target, stored, config.n_routed_experts)
        finally:
            tally.finish()
    return model


def _read_bytes(fill: _Fill, parts: int) -> int:
    """Stored bytes a fill reads: the whole tensor, or one of the ``parts`` of a split one."""
    return fill.entry.nbytes // (parts if fill.split is not None else 1)


def save_random_checkpoint(directory: str | Path, config: DeepseekV4Config, seed: int) -> Path:
    """Write a loadable random checkpoint (fp32, Hugging Face names) and return its directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = DeepseekV4ForCausalLM(config)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    try:
        save_config(directory, config)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint to {directory}: {exc}") from None
    return directory
