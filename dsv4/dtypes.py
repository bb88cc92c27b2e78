"""Compute dtypes: the names a run may ask for, what ``auto`` means, and what stays float32.

A model computes in one *compute dtype* (``DeepseekV4ForCausalLM.compute_dtype``): its
embeddings, activations, KV caches and every parameter except those transformers keeps in
float32 whatever the dtype. Invariants:
- ``COMPUTE_DTYPES`` is the one list of names (``float32``, ``bfloat16``, ``float16``); the CLI's
  ``--dtype`` choices and ``EngineSpec.dtype`` derive from it (``DTYPE_CHOICES`` adds ``auto``).
- ``auto`` is the checkpoint's own dtype, ``torch_dtype`` in its ``config.json`` (``dtype`` in
  configs transformers 5 writes); float32 for the built-in model and when the field is absent.
  A config naming any other dtype raises ``ConfigError`` (only when ``auto`` asks for it).
- ``keeps_float32(name)`` is transformers 5.23.0's ``_keep_in_fp32_modules_strict`` applied as
  its loader applies it: a parameter stays float32 when any listed module name occurs in its
  (Hugging Face) name, an unanchored search, so ``norm`` covers every norm weight. transformers
  applies the list in float16 and bfloat16; this model applies it in every dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv4.errors import ConfigError
from dsv4.hf_config import checkpoint_dtype_name

__all__ = [
    "COMPUTE_DTYPES",
    "DTYPE_CHOICES",
    "KEEP_IN_FP32_MODULES",
    "dtype_name",
    "keeps_float32",
    "parameter_dtype",
    "resolve_dtype",
]

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Every compute dtype a run may ask for, by name."""

DTYPE_CHOICES = ("auto", *COMPUTE_DTYPES)
"""What ``--dtype`` and ``EngineSpec.dtype`` accept."""

KEEP_IN_FP32_MODULES = (
    "attn_hc",
    "ffn_hc",
    "hc_head",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "q_a_norm",
    "kv_norm",
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
)
"""transformers' ``DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict``, verbatim: the
hyper-connections, attention sinks, compressor position biases, router correction bias, the
query and KV norms, the layer norms and the final norm."""


def keeps_float32(name: str) -> bool:
    """Whether the parameter or buffer called ``name`` stays float32 in every compute dtype."""
    return any(module in name for module in KEEP_IN_FP32_MODULES)


def parameter_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` has in a model computing in ``compute_dtype``."""
    return torch.float32 if keeps_float32(name) else compute_dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name ``--dtype`` and JSON payloads use)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(name: str, checkpoint: str | Path | None) -> torch.dtype:
    """The compute dtype ``name`` (one of ``DTYPE_CHOICES``) stands for with ``checkpoint``
    (``None`` for the built-in model); ``ValueError`` for any other name."""
    if name != "auto":
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
        return COMPUTE_DTYPES[name]
    declared = None if checkpoint is None else checkpoint_dtype_name(checkpoint)
    if declared is None:
        return torch.float32
    if declared.removeprefix("torch.") not in COMPUTE_DTYPES:
        raise ConfigError(
            f"config.json of {checkpoint} declares torch_dtype {declared!r}, which is not a "
            f"compute dtype ({', '.join(COMPUTE_DTYPES)}); choose one explicitly (--dtype)"
        )
    return COMPUTE_DTYPES[declared.removeprefix("torch.")]
