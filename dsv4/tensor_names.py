"""Tensor names: any supported checkpoint naming mapped to the one canonical (Hugging Face) name.

A checkpoint may name its tensors as Hugging Face does, as the official DeepSeek release does
(``layers.0.attn.wq_a.weight``, ``hc_attn_fn`` ...) or as ``transformers``' ``save_pretrained``
writes them (official sub-names under a ``model.`` prefix). Invariant: ``canonical_name`` is
idempotent, and a canonical name other than the LM head's starts with ``model.``.
"""

from __future__ import annotations

import re

__all__ = ["canonical_name"]

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


def canonical_name(name: str) -> str:
    """The Hugging Face name of a tensor named in any supported layout."""
    bare = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        bare = pattern.sub(replacement, bare)
    return bare if bare.startswith("lm_head.") else f"model.{bare}"
