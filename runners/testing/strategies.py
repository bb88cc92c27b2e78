"""What the conformance kit draws and runs: random tiny models and request batches (the
hypothesis strategies of ``dsv4.testing``, the one definition of both), and the fixed model and
prompts of the kit's deterministic pass.

Importable by platform authors (``from runners.testing.strategies import configs``). The models
are tiny so that capturing and replaying them on the CPU tape takes well under a second, yet
every layer type, window eviction and both compressors are exercised.
"""

from __future__ import annotations

from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4.testing import VOCAB, configs, indexer_weights, prompt_batches

__all__ = [
    "FIXED_PROMPTS",
    "VOCAB",
    "configs",
    "fixed_config",
    "indexer_weights",
    "prompt_batches",
]

FIXED_PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 17, 42, 8, 61, 3, 29, 11, 50, 2, 36),
    (7,),
    (9, 1, 40, 1, 23),
    (5, 17, 42, 8, 61, 3, 29, 11, 13, 6),
)
"""Four requests for the deterministic pass: 11 tokens (a chunked prefill past the window and
both compression rates), 1 (decode from the start), 5 (padding to a captured size) and 10 whose
first 8 are the first request's (the fixed model's prefix boundary at the kit's 4-token blocks),
admitted after those are computed: a prefix-cache hit in every configuration."""


def fixed_config() -> DeepseekV4Config:
    """The deterministic pass's model: all three layer types, both MoE kinds, two streams, and
    two indexer heads, so exact ties at the top-k cut occur in its prompts (a configuration
    that breaks them otherwise than eager, at another context width, fails here)."""
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        partial_rotary_factor=0.5,
        sliding_window=4,
        layer_types=(SLIDING, CSA, HCA),
        compress_rate_csa=2,
        compress_rate_hca=4,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        hc_mult=2,
        mlp_layer_types=("hash_moe", "moe", "moe"),
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
