"""``DeepseekV4Config``: reading Hugging Face configs like transformers does, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from dsv4.config import ARCHITECTURE, CSA, HCA, SLIDING, DeepseekV4Config
from dsv4.errors import ConfigError
from dsv4.hf_config import (
    CONFIG_FILE,
    UnsupportedArchitectureError,
    architecture_of,
    config_from_hf_dict,
    config_to_hf_dict,
    load_config,
    read_config_file,
    save_config,
)
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.rope import RotaryEmbedding
from dsv4.testing import configs
from runners import ModelRunnerV2
from runners.spec import EngineSpec, resolve_spec
from runners.spec import architecture_of as spec_architecture

BASE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 4,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "partial_rotary_factor": 0.25,
}
TYPES = [SLIDING, CSA, HCA]


@settings(max_examples=25)
@given(config=configs())
def test_hf_dict_round_trip(config: DeepseekV4Config) -> None:
    assert config_from_hf_dict(config_to_hf_dict(config)) == config


def test_tiny_preset_covers_every_layer_type_and_bytes(tmp_path: Path) -> None:
    tiny = DeepseekV4Config.tiny()
    assert set(tiny.layer_types) == set(TYPES)
    assert tiny.vocab_size >= 259 and {tiny.bos_token_id, tiny.eos_token_id} <= set(range(256, 320))
    path = save_config(tmp_path, tiny)
    assert path == tmp_path / CONFIG_FILE == tmp_path / "config.json"
    assert json.loads(path.read_text()) == config_to_hf_dict(tiny)
    assert read_config_file(path) == load_config(tmp_path) == tiny


HF_LAYOUTS: dict[str, dict[str, Any]] = {
    "legacy compress_ratios (cut to the layer count)": {"compress_ratios": [0, 4, 128, 4]},
    "legacy per-type rates": {
        "layer_types": TYPES,
        "compress_rate_csa": 2,
        "compress_rate_hca": 16,
    },
    "compress_rates dict and num_hash_layers": {
        "layer_types": [HCA, CSA, CSA],
        "compress_rates": {CSA: 3, HCA: 8},
        "num_hash_layers": 1,
    },
    "legacy qk_rope_head_dim": {
        "layer_types": TYPES,
        "partial_rotary_factor": None,
        "qk_rope_head_dim": 8,
    },
    "defaults everywhere": {"layer_types": None},
    "flat yarn": {
        "layer_types": TYPES,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "legacy rope_scaling": {
        "layer_types": TYPES,
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16,
        },
    },
    "nested yarn without attention_factor": {
        "layer_types": TYPES,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 5000.0},
            "compress": {
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 64,
            },
        },
    },
    "nested yarn with mscale, main yarn, compress theta inherited": {
        "layer_types": TYPES,
        "rope_theta": 2000.0,
        "rope_parameters": {
            "main": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
            "compress": {
                "rope_type": "yarn",
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_slow": 2,
            },
        },
    },
}


@pytest.mark.parametrize("extra", HF_LAYOUTS.values(), ids=list(HF_LAYOUTS))
def test_reads_hf_layouts_like_transformers(extra: dict[str, Any]) -> None:
    raw = {**BASE, **extra}
    ours = config_from_hf_dict(raw)
    hf = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if v is not None})
    assert list(ours.layer_types) == hf.layer_types
    assert list(ours.mlp_layer_types) == hf.mlp_layer_types
    assert {CSA: ours.compress_rate_csa, HCA: ours.compress_rate_hca} == hf.compress_rates
    hf_rope = DeepseekV4RotaryEmbedding(hf)
    for part, theta, yarn in (
        ("main", ours.rope_theta, ours.main_yarn),
        ("compress", ours.compress_rope_theta, ours.compress_yarn),
    ):
        rope = RotaryEmbedding(ours.rope_dim, theta, yarn)
        torch.testing.assert_close(rope.inv_freq, getattr(hf_rope, f"{part}_inv_freq"))
        assert rope.scaling == pytest.approx(getattr(hf_rope, f"{part}_attention_scaling"))


BAD: list[tuple[dict[str, Any], str]] = [
    ({"num_attention_heads": 6, "o_groups": 4}, "divisible by o_groups"),
    ({"partial_rotary_factor": 0.28125}, "must be even"),
    ({"partial_rotary_factor": 0.01}, "at least 2"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in"),
    ({"layer_types": TYPES, "index_head_dim": 4}, "exceed index_head_dim"),
    ({"layer_types": [SLIDING, "full_attention", HCA]}, "unknown layer_types"),
    ({"layer_types": [SLIDING, HCA]}, "has 2 entries for 3 layers"),
    ({"mlp_layer_types": ["moe", "dense", "moe"]}, "unknown mlp_layer_types"),
    ({"compress_ratios": [0, 16, 128]}, "legacy compress_ratios"),
    ({"compress_rates": {"sliding_attention": 2}}, "compress_rates has unknown"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"num_experts_per_tok": 5}, "exceeds n_routed_experts"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "numeric 'factor'"),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "truncate": False}},
        "truncate=false",
    ),
    (
        {"rope_parameters": {"main": {"partial_rotary_factor": 0.5}, "compress": {}}},
        "different partial_rotary_factor",
    ),
    ({"model_type": "llama"}, "model_type 'llama'"),
    (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "config.json names architecture 'LlamaForCausalLM', which this library does not "
        "implement (supported: DeepseekV4ForCausalLM)",
    ),
    (
        {"architectures": [ARCHITECTURE, "DeepseekV3ForCausalLM"]},
        "architecture 'DeepseekV3ForCausalLM'",
    ),
    ({"architectures": ARCHITECTURE}, "'architectures' must be a list of strings"),
    ({"hidden_size": "big"}, "'hidden_size' must be an integer"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_invalid_configs_give_one_line_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config_from_hf_dict({**BASE, **change})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_unreadable_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        read_config_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        read_config_file(tmp_path / "list.json")


def test_the_architecture_name_has_one_definition() -> None:
    assert ARCHITECTURE == DeepseekV4ForCausalLM.__name__ == "DeepseekV4ForCausalLM"
    assert config_to_hf_dict(DeepseekV4Config.tiny())["architectures"] == [ARCHITECTURE]
    assert architecture_of({}) == architecture_of({"architectures": [ARCHITECTURE]}) == ARCHITECTURE
    with pytest.raises(UnsupportedArchitectureError) as error:
        architecture_of({"architectures": ["LlamaForCausalLM"]})
    assert (error.value.architecture, error.value.supported) == (
        "LlamaForCausalLM",
        (ARCHITECTURE,),
    )
    assert isinstance(error.value, ConfigError)


def test_an_engine_for_another_architecture_is_refused_before_resolution(tmp_path: Path) -> None:
    """It used to load the DeepSeek-V4 model anyway, on the runner the other name resolved to."""
    raw = {**config_to_hf_dict(DeepseekV4Config.tiny()), "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = EngineSpec(checkpoint=tmp_path, platform="cpu")
    with pytest.raises(UnsupportedArchitectureError, match="'LlamaForCausalLM'"):
        resolve_spec(spec)
    assert spec_architecture(EngineSpec()) == ARCHITECTURE
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": [ARCHITECTURE]}))
    assert resolve_spec(spec).runner is ModelRunnerV2
