"""Shared test support: hypothesis strategies for tiny configs and the Hugging Face oracle.

Configs are tiny (hidden <= 32, <= 3 layers) so one example costs well under a second, yet they
mix all three layer types, windows shorter and longer than the prompts, CSA rates down to 1 and
lowered HCA rates, YaRN on and off (in both RoPE parts), rotary fractions, ``o_groups``, MoE
shapes, hash and top-k routing, both scoring functions, and >= 16 indexer heads: an entry
scores exactly 0 when ReLU zeroes every head (probability about ``2**-heads`` per token and
entry), and two such zeros straddling the top-k cut are a legitimate tie that ``torch.topk``
breaks differently for different row lengths (ours: the request's capacity; the reference:
the sequence length). With 8-10 heads, rate-1 CSA and 37-token prompts that happened.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from hypothesis import assume
from hypothesis import strategies as st

from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.weights import randomize_

VOCAB = 64

yarns = st.none() | st.builds(
    YarnScaling,
    factor=st.sampled_from([2.0, 4.0, 8.0]),
    original_max_position_embeddings=st.sampled_from([16, 32, 64]),
    beta_fast=st.sampled_from([32.0, 8.0]),
    beta_slow=st.sampled_from([1.0, 2.0]),
    attention_factor=st.sampled_from([1.0, 1.1]),
)


@st.composite
def configs(draw: st.DrawFn, *, max_layers: int = 3) -> DeepseekV4Config:
    """A random tiny configuration (every constraint of the config satisfied)."""
    layers = draw(st.integers(1, max_layers))
    o_groups = draw(st.integers(1, 2))
    heads = o_groups * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([8, 12, 16]))
    rope_dim = draw(st.sampled_from([d for d in (2, 4, 6, 8) if d <= head_dim]))
    factor = rope_dim / head_dim
    assume(int(head_dim * factor) == rope_dim)
    experts = draw(st.integers(1, 5))
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=draw(st.sampled_from([16, 32])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=draw(st.sampled_from([8, 16])),
        o_groups=o_groups,
        o_lora_rank=draw(st.sampled_from([4, 8])),
        partial_rotary_factor=factor,
        sliding_window=draw(st.integers(1, 12)),
        layer_types=draw(layer_types(layers)),
        compress_rate_csa=draw(st.integers(1, 4)),
        compress_rate_hca=draw(st.integers(2, 8)),
        index_n_heads=draw(st.integers(16, 18)),
        index_head_dim=draw(st.sampled_from([d for d in (8, 12) if d >= rope_dim])),
        index_topk=draw(st.integers(1, 6)),
        rope_theta=draw(st.sampled_from([10000.0, 500.0])),
        compress_rope_theta=draw(st.sampled_from([160000.0, 1000.0])),
        main_yarn=draw(yarns),
        compress_yarn=draw(yarns),
        hc_mult=draw(st.integers(1, 3)),
        hc_sinkhorn_iters=draw(st.integers(1, 6)),
        mlp_layer_types=draw(
            st.lists(st.sampled_from(["hash_moe", "moe"]), min_size=layers, max_size=layers)
        ),
        moe_intermediate_size=draw(st.sampled_from([8, 16])),
        n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(experts, 3))),
        scoring_func=draw(st.sampled_from(["sqrtsoftplus", "sigmoid"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 1.5])),
        swiglu_limit=draw(st.sampled_from([10.0, 0.5])),
        max_position_embeddings=128,
        tie_word_embeddings=draw(st.booleans()),
    )


def layer_types(layers: int) -> st.SearchStrategy[list[str]]:
    """Distinct types in random order (so every type is common), or any mix with repeats."""
    distinct = st.permutations([SLIDING, CSA, HCA]).map(lambda types: types[:layers])
    mixed = st.lists(st.sampled_from([SLIDING, CSA, HCA]), min_size=layers, max_size=layers)
    return distinct | mixed


def prompts(min_len: int = 1, max_len: int = 40) -> st.SearchStrategy[list[int]]:
    """Token lists whose length is drawn first (plain lists would be mostly very short)."""
    tokens = st.integers(0, VOCAB - 1)
    return st.integers(min_len, max_len).flatmap(lambda n: st.lists(tokens, min_size=n, max_size=n))


def chunk_sizes(length: int, max_chunk: int) -> st.SearchStrategy[list[int]]:
    """A random split of ``length`` tokens into chunks of at most ``max_chunk``."""

    @st.composite
    def split(draw: st.DrawFn) -> list[int]:
        sizes, left = [], length
        while left:
            size = draw(st.integers(1, min(left, max_chunk)))
            sizes.append(size)
            left -= size
        return sizes

    return split()


def random_model(config: DeepseekV4Config, seed: int) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(config)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    return model


def hf_twin(model: DeepseekV4ForCausalLM) -> transformers.DeepseekV4ForCausalLM:
    """The Hugging Face model with the same config and weights (eager attention)."""
    hf_config = transformers.DeepseekV4Config(**model.config.to_hf_dict())
    hf = transformers.DeepseekV4ForCausalLM(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def hf_logits(hf: transformers.DeepseekV4ForCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    """Uncached Hugging Face logits ``[len(prompt), vocab]`` of one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([list(prompt)]), use_cache=False).logits[0].float()


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
