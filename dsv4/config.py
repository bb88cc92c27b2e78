"""``DeepseekV4Config``: the model's hyper-parameters as one frozen, validated value.

Field names follow the Hugging Face ``config.json`` of DeepSeek-V4 (transformers 5.23.0) so a
reader can map one to the other; the two per-type compression rates and the two RoPE parts are
flattened into plain fields (``compress_rate_csa``/``compress_rate_hca``, ``main_yarn`` /
``compress_yarn``). ``dsv4.hf_config`` (the floor above: it reads and writes this value)
converts from and to the Hugging Face layout, including its legacy spellings
(``config_from_hf_dict``, ``config_to_hf_dict``, ``read_config_file``).

Invariants (checked at construction, violations raise ``ConfigError`` naming the field):
- ``layer_types``/``mlp_layer_types`` have one known entry per layer;
- the rotary part ``rope_dim = int(head_dim * partial_rotary_factor)`` is even, at least 2, and
  fits in the head (and in the indexer head when a CSA layer exists);
- heads split evenly into ``o_groups``; one KV head; routing picks at most every expert.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from dsv4.errors import ConfigError

__all__ = [
    "ARCHITECTURE",
    "CSA",
    "HCA",
    "LAYER_TYPES",
    "MLP_LAYER_TYPES",
    "SLIDING",
    "DeepseekV4Config",
    "YarnScaling",
]

ARCHITECTURE = "DeepseekV4ForCausalLM"
"""The ``architectures`` entry of ``config.json`` this library implements (the name of the model
class ``DeepseekV4ForCausalLM``); every other use of the name derives from this one."""

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


@attrs.frozen(kw_only=True)
class YarnScaling:
    """YaRN scaling of one RoPE part (the reference always truncates the correction range)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    """Multiplies cos and sin; the reference forces 1.0 for the flat ``compress`` layout."""


def _default_layer_types(config: DeepseekV4Config) -> tuple[str, ...]:
    """The reference default: two HCA layers, then CSA and HCA alternating."""
    n = config.num_hidden_layers
    rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return tuple([HCA] * min(n, 2) + rest)


def _default_mlp_layer_types(config: DeepseekV4Config) -> tuple[str, ...]:
    n = config.num_hidden_layers
    return tuple(["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0))


def _tuple_of_str(value: Any) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class DeepseekV4Config:
    """Hyper-parameters of a DeepSeek-V4 model (defaults: the reference's defaults)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    partial_rotary_factor: float = 64 / 512
    sliding_window: int = 128
    layer_types: tuple[str, ...] = attrs.field(
        converter=_tuple_of_str, default=attrs.Factory(_default_layer_types, takes_self=True)
    )
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    main_yarn: YarnScaling | None = None
    compress_yarn: YarnScaling | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] = attrs.field(
        converter=_tuple_of_str, default=attrs.Factory(_default_mlp_layer_types, takes_self=True)
    )
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 1
    """Multi-token-prediction layers of the checkpoint; not instantiated (their tensors are
    skipped on load)."""

    def __attrs_post_init__(self) -> None:
        problem = _first_problem(self)
        if problem is not None:
            raise ConfigError(f"invalid DeepSeek-V4 config: {problem}")

    # -- derived values ----------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        """Rotary channels per head: the trailing ``rope_dim`` channels are rotated."""
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer_type: str) -> int:
        """Compression rate of a CSA or HCA layer."""
        return self.compress_rate_csa if layer_type == CSA else self.compress_rate_hca

    @classmethod
    def tiny(cls) -> DeepseekV4Config:
        """A built-in tiny model with all three layer types and a byte-level vocabulary.

        Tokens 0..255 are bytes; 256 is BOS, 257 EOS, 258 padding. Its windows and rates are
        small so that short prompts already exercise window eviction and both compressors.
        """
        return cls(
            vocab_size=320,
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            head_dim=32,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=32,
            partial_rotary_factor=0.25,
            sliding_window=8,
            layer_types=(SLIDING, CSA, HCA),
            compress_rate_csa=4,
            compress_rate_hca=16,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=4,
            compress_yarn=YarnScaling(factor=4.0, original_max_position_embeddings=256),
            hc_mult=4,
            mlp_layer_types=("hash_moe", "moe", "moe"),
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=1024,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )

    @classmethod
    def small(cls) -> DeepseekV4Config:
        """A larger random-weight model for benchmarks (``init-checkpoint --preset small``).

        Same byte-level vocabulary as ``tiny``; four layers (CSA twice), 16 routed experts of
        which each token takes 4 (so one-token decode steps run the MoE on gathered weights and
        larger batches run every expert), windows and top-k closer to real proportions. It
        declares 65 536 positions (the long-context benchmarks need them), with the compressed
        RoPE's YaRN consistent with that (factor 4 over 16 384 original positions, so
        transformers takes the factor as given).
        """
        return cls(
            vocab_size=320,
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            head_dim=64,
            q_lora_rank=256,
            o_groups=4,
            o_lora_rank=128,
            partial_rotary_factor=0.25,
            sliding_window=64,
            layer_types=(SLIDING, CSA, HCA, CSA),
            compress_rate_csa=4,
            compress_rate_hca=16,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=16,
            compress_yarn=YarnScaling(factor=4.0, original_max_position_embeddings=16384),
            hc_mult=4,
            mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
            moe_intermediate_size=256,
            n_routed_experts=16,
            num_experts_per_tok=4,
            max_position_embeddings=65536,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )


POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "compress_rate_csa",
    "compress_rate_hca",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
)


def _first_problem(c: DeepseekV4Config) -> str | None:
    for name in POSITIVE_INT_FIELDS:
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be a positive integer, got {value!r}"
    for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps", "routed_scaling_factor"):
        value = getattr(c, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            return f"{name} must be a positive number, got {value!r}"
    if not isinstance(c.hc_eps, int | float) or c.hc_eps < 0:
        return f"hc_eps must be a non-negative number, got {c.hc_eps!r}"
    if not isinstance(c.swiglu_limit, int | float) or c.swiglu_limit <= 0:
        return f"swiglu_limit must be a positive number, got {c.swiglu_limit!r}"
    for name, types, allowed in (
        ("layer_types", c.layer_types, LAYER_TYPES),
        ("mlp_layer_types", c.mlp_layer_types, MLP_LAYER_TYPES),
    ):
        if len(types) != c.num_hidden_layers:
            return f"{name} has {len(types)} entries for {c.num_hidden_layers} layers"
        unknown = sorted({t for t in types if t not in allowed})
        if unknown:
            return f"unknown {name} {unknown}; expected entries from {list(allowed)}"
    if c.num_attention_heads % c.o_groups:
        return (
            f"num_attention_heads ({c.num_attention_heads}) must be divisible by "
            f"o_groups ({c.o_groups})"
        )
    if not 0 < c.partial_rotary_factor <= 1:
        return f"partial_rotary_factor must be in (0, 1], got {c.partial_rotary_factor!r}"
    if c.rope_dim < 2 or c.rope_dim % 2:
        return (
            f"rotary dims int(head_dim * partial_rotary_factor) = {c.rope_dim} must be even "
            "and at least 2"
        )
    if CSA in c.layer_types and c.rope_dim > c.index_head_dim:
        return (
            f"rotary dims ({c.rope_dim}) exceed index_head_dim ({c.index_head_dim}); the indexer "
            "rotates the same trailing channels"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        return (
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts "
            f"({c.n_routed_experts})"
        )
    if c.scoring_func not in SCORING_FUNCS:
        return f"scoring_func {c.scoring_func!r} is not supported; expected one of {SCORING_FUNCS}"
    for name, yarn in (("main", c.main_yarn), ("compress", c.compress_yarn)):
        if yarn is not None and (yarn.factor <= 0 or yarn.original_max_position_embeddings < 1):
            return f"rope_parameters[{name!r}] YaRN needs factor > 0 and a positive original length"
    return None
