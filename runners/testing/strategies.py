"""Hypothesis strategies for platform conformance: tiny models and request batches, and the
fixed model and prompts of the kit's deterministic pass.

Importable by platform authors (``from runners.testing.strategies import tiny_configs``).
The models are tiny so that capturing and replaying them on the CPU tape takes well under a
second, yet every layer type, window eviction and both compressors are exercised.
"""

from __future__ import annotations

from hypothesis import strategies as st

from dsv4.config import DeepseekV4Config

__all__ = ["FIXED_PROMPTS", "VOCAB", "fixed_config", "prompt_batches", "tiny_configs"]

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


FIXED_PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 17, 42, 8, 61, 3, 29, 11, 50, 2, 36),
    (7,),
    (9, 1, 40, 1, 23),
)
"""Three requests for the deterministic pass: 11 tokens (a chunked prefill past the window and
both compression rates), 1 (decode from the start) and 5 (padding to a captured size)."""


def fixed_config() -> DeepseekV4Config:
    """The deterministic pass's model: all three layer types, both MoE kinds, two streams."""
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
        layer_types=_TYPES,
        compress_rate_csa=2,
        compress_rate_hca=4,
        index_n_heads=8,
        index_head_dim=8,
        index_topk=2,
        hc_mult=2,
        mlp_layer_types=("hash_moe", "moe", "moe"),
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
