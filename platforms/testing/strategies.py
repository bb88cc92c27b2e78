"""Hypothesis strategies for platform conformance: tiny models and request batches.

Importable by platform authors (``from platforms.testing.strategies import tiny_configs``).
The models are tiny so that capturing and replaying them on the CPU tape takes well under a
second, yet every layer type, window eviction and both compressors are exercised.
"""

from __future__ import annotations

from hypothesis import strategies as st

from dsv4.config import DeepseekV4Config

__all__ = ["VOCAB", "prompt_batches", "tiny_configs"]

VOCAB = 64
_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@st.composite
def tiny_configs(draw: st.DrawFn, *, max_layers: int = 3) -> DeepseekV4Config:
    """A random tiny configuration: 1-3 layers of any attention types, small windows and rates."""
    layers = draw(st.integers(1, max_layers))
    types = draw(st.lists(st.sampled_from(_TYPES), min_size=layers, max_size=layers))
    o_groups = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([8, 16]))
    experts = draw(st.integers(1, 4))
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=draw(st.sampled_from([16, 32])),
        num_hidden_layers=layers,
        num_attention_heads=o_groups * draw(st.integers(1, 2)),
        head_dim=head_dim,
        q_lora_rank=16,
        o_groups=o_groups,
        o_lora_rank=8,
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5])),
        sliding_window=draw(st.integers(2, 8)),
        layer_types=tuple(types),
        compress_rate_csa=draw(st.integers(2, 4)),
        compress_rate_hca=draw(st.integers(3, 8)),
        index_n_heads=8,
        index_head_dim=8,
        index_topk=draw(st.integers(1, 4)),
        hc_mult=draw(st.integers(1, 2)),
        mlp_layer_types=tuple(
            draw(st.lists(st.sampled_from(["hash_moe", "moe"]), min_size=layers, max_size=layers))
        ),
        moe_intermediate_size=16,
        n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(experts, 2))),
        max_position_embeddings=64,
    )


def prompt_batches(
    *, max_requests: int = 3, max_len: int = 13
) -> st.SearchStrategy[list[list[int]]]:
    """Batches of prompts of different lengths (1 .. ``max_len`` tokens)."""
    prompt = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_len)
    return st.lists(prompt, min_size=1, max_size=max_requests)
