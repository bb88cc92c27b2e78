"""Checkpoints: ``config.json`` plus ``*.safetensors`` in the Hugging Face layout.

Tensor names may be the Hugging Face names (what ``save_random_checkpoint`` writes), the
official DeepSeek names (``layers.0.attn.wq_a.weight``, per-expert ``ffn.experts.{e}.w1/w2/w3``,
``hc_attn_fn`` ...) or the mix ``transformers`` itself writes on ``save_pretrained`` (official
sub-names under a ``model.`` prefix); all are mapped to one canonical (Hugging Face) name.
Multi-token-prediction tensors (``mtp.*``) are skipped, as the reference does.

Loading is strict: a missing, unexpected or mis-shaped tensor or an unreadable file raises
``CheckpointError`` naming the tensor and file; the model is only returned when every parameter
and persistent buffer was filled. The published quantized layout (``config.json`` with a
``quantization_config``: FP8 block linears, MXFP4 or FP8 experts) is read by
``dsv4.quantized_loading`` (weight-only or dequantized, ``quantization=``); quantized bytes or
scales in a checkpoint without that config are refused. Values are checked
too, since a bad one would otherwise surface as garbage tokens (NaN weights decode to token 0) or
as an indexing failure deep inside a graph capture: ``TensorValueError`` names the tensor, the
file, the first bad value and what was expected when a floating tensor holds NaN or inf once in
the model's dtype (one ``isfinite`` pass per tensor), or a hash-routing table ``tid2eid`` holds an
expert id outside ``0 .. n_routed_experts-1``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.config import DeepseekV4Config
from dsv4.errors import CheckpointError
from dsv4.hf_config import load_config, save_config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.weights import randomize_

__all__ = ["TensorValueError", "canonical_name", "load_checkpoint", "save_random_checkpoint"]

_RENAMES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight$", "embed_tokens.weight"),
        (r"^head\.weight$", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
)
_EXPERT_PIECE = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$"
)
_SKIPPED = re.compile(r"(^|\.)mtp\.")
_QUANT_SCALE = re.compile(r"(\.scale|_scale_inv|\.scale_inv)$")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_INT_DTYPES = {"I16", "I32", "I64", "U16", "U32"}
_HASH_TABLE = ".mlp.gate.tid2eid"
"""Canonical-name suffix of a hash layer's token-to-expert table."""


class TensorValueError(CheckpointError):
    """A tensor of the right name, dtype and shape whose values the model cannot run with."""

    def __init__(self, tensor: str, file: str, reason: str) -> None:
        self.tensor = tensor
        self.file = file
        self.reason = reason
        super().__init__(f"tensor {tensor!r} in {file} {reason}")


def canonical_name(name: str) -> str:
    """The Hugging Face name of a tensor named in any supported layout."""
    bare = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        bare = pattern.sub(replacement, bare)
    return bare if bare.startswith("lm_head.") else f"model.{bare}"


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


def _tensors(directory: Path) -> list[tuple[Path, str]]:
    files = _shards(directory)
    entries: list[tuple[Path, str]] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                entries.extend((path, key) for key in handle.keys())  # noqa: SIM118
        except Exception as exc:
            raise CheckpointError(f"cannot read {path.name}: {exc}".splitlines()[0]) from None
    return entries


def _read(path: Path, key: str, expected: torch.Tensor) -> torch.Tensor:
    """Read one tensor in the model's dtype, checking its dtype and shape against the model's
    and that every value is finite there (a NaN, an inf, or an overflow of the cast)."""
    with safe_open(str(path), framework="pt") as handle:
        piece = handle.get_slice(key)
        dtype, shape = piece.get_dtype(), tuple(piece.get_shape())
        allowed = _FLOAT_DTYPES if expected.is_floating_point() else _INT_DTYPES
        if dtype not in allowed:
            quantized = dtype.startswith(("F8", "F4", "F6", "U8", "I8"))
            why = " (quantized, but config.json has no quantization_config)" if quantized else ""
            raise CheckpointError(
                f"tensor {key!r} in {path.name} is {dtype}{why}; expected one of {sorted(allowed)}"
            )
        if shape != tuple(expected.shape):
            raise CheckpointError(
                f"tensor {key!r} in {path.name} has shape {list(shape)}, "
                f"expected {list(expected.shape)}"
            )
        stored = handle.get_tensor(key)
    value = stored.to(expected.dtype)
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = ~torch.isfinite(value)
        first = bad.nonzero()[0].tolist()
        count = f"{int(bad.sum())} of {value.numel()}"
        was = stored[tuple(first)].item()
        if math.isfinite(was):
            dtype_name = str(value.dtype).removeprefix("torch.")
            reason = (
                f"has values that overflow {dtype_name}: {count}, the first {was:g} at index "
                f"{first}; load it in float32 or bfloat16"
            )
        else:
            reason = (
                f"has non-finite values (NaN or inf): {count}, the first {was} at index {first}; "
                "the weights are corrupt"
            )
        raise TensorValueError(key, path.name, reason)
    return value


def _check_expert_ids(table: torch.Tensor, path: Path, key: str, num_experts: int) -> None:
    """Every entry of a hash-routing table must name one of the ``num_experts`` experts."""
    bad = (table < 0) | (table >= num_experts)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise TensorValueError(
            key,
            path.name,
            f"holds expert id {int(table[tuple(first)])} at index {first} (token {first[0]}); "
            f"expert ids must be in 0..{num_experts - 1} (n_routed_experts={num_experts})",
        )


def _merge_experts(
    directory: Path,
    pieces: dict[str, dict[tuple[int, str], tuple[Path, str]]],
    targets: dict[str, torch.Tensor],
    num_experts: int,
) -> dict[str, tuple[Path, str] | torch.Tensor]:
    """Stack official per-expert ``w1``/``w3`` (gate, up) and ``w2`` (down) into the HF layout."""
    merged: dict[str, tuple[Path, str] | torch.Tensor] = {}
    for prefix, found in pieces.items():
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if gate_up not in targets:
            path, key = next(iter(found.values()))
            raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
        half = targets[gate_up].shape[1] // 2
        rows = []
        for e in range(num_experts):
            for w in ("w1", "w2", "w3"):
                if (e, w) not in found:
                    raise CheckpointError(
                        f"checkpoint {directory} is missing tensor '{prefix}.{e}.{w}.weight'"
                    )
            w1, w3, w2 = (
                _read(*found[(e, w)], targets[gate_up][e, :half] if w != "w2" else targets[down][e])
                for w in ("w1", "w3", "w2")
            )
            rows.append((torch.cat((w1, w3)), w2))
        merged[gate_up] = torch.stack([r[0] for r in rows])
        merged[down] = torch.stack([r[1] for r in rows])
    return merged


def load_checkpoint(
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "auto",
) -> DeepseekV4ForCausalLM:
    """Build the model described by ``directory/config.json`` and fill it from its safetensors.

    ``dtype`` is the compute dtype (``dsv4.dtypes``: the fp32-kept parameters stay float32).
    The parameters are allocated once, uninitialised, in their final dtypes, and each tensor is
    converted once, from the file straight into its parameter's dtype (never through a float32
    copy of the model).

    ``quantization`` (``auto``, ``weight-only``, ``dequantize``) is how a quantized checkpoint
    loads (``dsv4.quantized_loading``; ``auto`` is weight-only); a plain one ignores it."""
    from dsv4.quantized_loading import load_quantized, plan_quantized  # it imports this module

    directory = Path(directory)
    config = load_config(directory)
    model = DeepseekV4ForCausalLM(config, device=device, dtype=dtype, initialize=False)
    targets = dict(model.state_dict(keep_vars=True))
    if config.tie_word_embeddings:
        targets.pop("lm_head.weight")
    sources: dict[str, tuple[Path, str] | torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, str], tuple[Path, str]]] = {}
    entries = _tensors(directory)
    plan = plan_quantized(
        directory,
        entries,
        targets,
        mode=quantization,
        num_experts=config.n_routed_experts,
        tied=config.tie_word_embeddings,
    )
    claimed = plan.claimed if plan is not None else frozenset()
    for path, key in entries:
        if _SKIPPED.search(key) or key in claimed:
            continue
        name = canonical_name(key)
        piece = _EXPERT_PIECE.match(name)
        if piece is not None:
            found = pieces.setdefault(piece["prefix"], {})
            found[(int(piece["expert"]), piece["w"])] = (path, key)
        elif name in targets:
            sources[name] = (path, key)
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        elif _QUANT_SCALE.search(key):
            raise CheckpointError(
                f"tensor {key!r} in {path.name} is a quantization scale, but config.json has no "
                "quantization_config"
            )
        else:
            raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
    sources.update(_merge_experts(directory, pieces, targets, config.n_routed_experts))
    provided = plan.provides if plan is not None else frozenset()
    missing = [name for name in targets if name not in sources and name not in provided]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {directory} is missing tensor {missing[0]!r}{more}")
    with torch.no_grad():
        filled = load_quantized(model, plan, targets) if plan is not None else set()
        for name, target in targets.items():
            if name in filled:
                continue
            source = sources[name]
            if isinstance(source, torch.Tensor):
                target.copy_(source)
                continue
            value = _read(*source, target)
            if name.endswith(_HASH_TABLE):
                _check_expert_ids(value, *source, config.n_routed_experts)
            target.copy_(value)
    return model


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
