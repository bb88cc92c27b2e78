"""The Hugging Face ``config.json``: reading and writing the file, and converting its dict to and
from ``DeepseekV4Config``. Every read or write of a ``config.json`` goes through this module.

Reading follows transformers 5.23.0 exactly where it changes the numbers:
- ``layer_types`` wins over the legacy per-layer ``compress_ratios`` (0 → sliding, 4 → CSA,
  128 → HCA); both are cut to ``num_hidden_layers`` (checkpoints list the MTP layer too).
- ``compress_rates`` (dict per layer type), overridden by legacy ``compress_rate_csa`` /
  ``compress_rate_hca``; ``mlp_layer_types`` defaults to ``num_hash_layers`` (3) hash layers.
- ``partial_rotary_factor`` defaults to the legacy ``qk_rope_head_dim / head_dim``.
- ``rope_parameters`` (or the legacy ``rope_scaling``) either nested as ``{"main", "compress"}``
  or flat; a flat dict's YaRN keys apply to the compress part only (``dsv4.hf_rope``).

Values the reference accepts but this model does not implement raise ``ConfigError`` instead of
being ignored silently (see the README section on supported fields); an ``architectures`` entry
other than ``ARCHITECTURE`` raises its subclass ``UnsupportedArchitectureError``, so a config
written for another model is never run as DeepSeek-V4. A checkpoint directory without a
``config.json`` raises ``CheckpointError``; a file that is not a JSON object, ``ConfigError``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv4.config import (
    ARCHITECTURE,
    CSA,
    HCA,
    POSITIVE_INT_FIELDS,
    SLIDING,
    DeepseekV4Config,
)
from dsv4.errors import CheckpointError, ConfigError
from dsv4.hf_rope import read_rope_part, rope_part_dict

__all__ = [
    "CONFIG_FILE",
    "UnsupportedArchitectureError",
    "architecture_of",
    "checkpoint_architecture",
    "checkpoint_dtype_name",
    "config_from_hf_dict",
    "config_to_hf_dict",
    "load_config",
    "read_config_file",
    "save_config",
]

CONFIG_FILE = "config.json"
"""The name of the config file in a Hugging Face checkpoint directory."""


class UnsupportedArchitectureError(ConfigError):
    """``config.json`` names an architecture this library does not implement."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        self.supported = (ARCHITECTURE,)
        super().__init__(
            f"config.json names architecture {architecture!r}, which this library does not "
            f"implement (supported: {', '.join(self.supported)})"
        )


_LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}

_INT_FIELDS = (
    *(f for f in POSITIVE_INT_FIELDS if not f.startswith("compress_rate")),
    "num_nextn_predict_layers",
)
_FLOAT_FIELDS = (
    "rope_theta",
    "compress_rope_theta",
    "hc_eps",
    "routed_scaling_factor",
    "swiglu_limit",
    "rms_norm_eps",
    "initializer_range",
)

# Fields the reference reads whose other values this model does not implement.
_FIXED = {"mlp_bias": False, "hidden_act": "silu"}

# Fields the reference accepts and then ignores: its model is the same whatever they say (one KV
# head, one shared expert, renormalised top-k weights, no attention bias). Other values are
# accepted with one warning, as transformers accepts them.
_IGNORED_BY_REFERENCE = {
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "attention_bias": False,
}


class IgnoredConfigFieldWarning(UserWarning):
    """A ``config.json`` field the model ignores, as transformers' DeepSeek-V4 does."""


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field {key!r} must be an integer, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config field {key!r} must be a number, got {value!r}")
    return float(value)


def _str_list(raw: Mapping[str, Any], key: str, n: int) -> tuple[str, ...]:
    value = raw[key]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config field {key!r} must be a list of strings, got {value!r}")
    return tuple(value[:n])


def _partial_rotary_factor(fields: dict[str, Any], raw: Mapping[str, Any], parts: list[Any]) -> Any:
    explicit = raw.get("partial_rotary_factor")
    in_parts = {
        p["partial_rotary_factor"]
        for p in parts
        if isinstance(p, Mapping) and p.get("partial_rotary_factor") is not None
    }
    if explicit is not None:
        in_parts.add(explicit)
    if len(in_parts) > 1:
        raise ConfigError(
            f"rope parts use different partial_rotary_factor values {sorted(in_parts)}; "
            "only one rotary size per model is supported"
        )
    if in_parts:
        return in_parts.pop()
    if raw.get("qk_rope_head_dim") is not None:
        return _int(raw, "qk_rope_head_dim") / fields.get("head_dim", 512)
    return 64 / 512


def _layer_types(raw: Mapping[str, Any], n: int) -> tuple[str, ...] | None:
    if raw.get("layer_types") is not None:
        return _str_list(raw, "layer_types", n)
    ratios = raw.get("compress_ratios")
    if ratios is None:
        return None
    if not isinstance(ratios, list | tuple):
        raise ConfigError(f"config field 'compress_ratios' must be a list, got {ratios!r}")
    unknown = sorted({r for r in ratios if r not in _LEGACY_RATIO_TYPES}, key=str)
    if unknown:
        raise ConfigError(
            f"legacy compress_ratios entries {unknown} are not understood; expected 0, 4 or 128 "
            "(or give layer_types and compress_rates)"
        )
    return tuple(_LEGACY_RATIO_TYPES[r] for r in ratios[:n])


def architecture_of(raw: Mapping[str, Any]) -> str:
    """The architecture a ``config.json`` dict names: ``ARCHITECTURE``, also when it names none
    (``model_type`` then decides); any other entry raises ``UnsupportedArchitectureError``."""
    names = raw.get("architectures")
    if names is None:
        return ARCHITECTURE
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"config field 'architectures' must be a list of strings, got {names!r}")
    for name in names:
        if name != ARCHITECTURE:
            raise UnsupportedArchitectureError(name)
    return ARCHITECTURE


def config_from_hf_dict(raw: Mapping[str, Any]) -> DeepseekV4Config:
    """Build a ``DeepseekV4Config`` from a Hugging Face ``config.json`` dict."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    architecture_of(raw)
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"model_type {raw['model_type']!r} is not 'deepseek_v4'")
    for key, expected in _FIXED.items():
        if key in raw and raw[key] is not None and raw[key] != expected:
            raise ConfigError(f"{key}={raw[key]!r} is not supported (only {expected!r})")
    ignored = [
        f"{key}={raw[key]!r}"
        for key, default in _IGNORED_BY_REFERENCE.items()
        if raw.get(key) is not None and raw[key] != default
    ]
    if ignored:
        warnings.warn(
            IgnoredConfigFieldWarning(
                f"config fields {', '.join(ignored)} are ignored, as transformers' DeepSeek-V4 "
                "ignores them (its model is the same whatever they say)"
            ),
            stacklevel=2,
        )
    fields: dict[str, Any] = {k: _int(raw, k) for k in _INT_FIELDS if raw.get(k) is not None}
    fields.update({k: _float(raw, k) for k in _FLOAT_FIELDS if raw.get(k) is not None})
    n = fields.get("num_hidden_layers", 43)
    layer_types = _layer_types(raw, n)
    if layer_types is not None:
        fields["layer_types"] = layer_types
    if raw.get("mlp_layer_types") is not None:
        fields["mlp_layer_types"] = _str_list(raw, "mlp_layer_types", n)
    elif raw.get("num_hash_layers") is not None:
        n_hash = _int(raw, "num_hash_layers")
        fields["mlp_layer_types"] = ("hash_moe",) * min(n, n_hash) + ("moe",) * max(n - n_hash, 0)
    rates = dict(raw.get("compress_rates") or {})
    unknown_rates = sorted(set(rates) - {CSA, HCA})
    if unknown_rates:
        raise ConfigError(f"compress_rates has unknown layer types {unknown_rates}")
    for key, legacy, field in (
        (CSA, "compress_rate_csa", "compress_rate_csa"),
        (HCA, "compress_rate_hca", "compress_rate_hca"),
    ):
        if raw.get(legacy) is not None:
            rates[key] = raw[legacy]
        if key in rates:
            fields[field] = _int(rates, key)
    for key in ("scoring_func",):
        if raw.get(key) is not None:
            fields[key] = str(raw[key])
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    for key in ("bos_token_id", "pad_token_id"):
        if key in raw:
            fields[key] = raw[key]
    if "eos_token_id" in raw:
        eos = raw["eos_token_id"]
        fields["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos

    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"rope_parameters must be a dict, got {rope!r}")
    nested = isinstance(rope.get("main"), Mapping) and isinstance(rope.get("compress"), Mapping)
    parts = [rope["main"], rope["compress"]] if nested else [rope]
    fields["partial_rotary_factor"] = float(_partial_rotary_factor(fields, raw, parts))
    max_pos = fields.get("max_position_embeddings", 1048576)
    theta = fields.get("rope_theta", 10000.0)
    if nested:
        fields["rope_theta"], fields["main_yarn"] = read_rope_part(
            rope["main"], "main", theta, max_pos, False
        )
        fields["compress_rope_theta"], fields["compress_yarn"] = read_rope_part(
            rope["compress"], "compress", theta, max_pos, False
        )
    else:
        compress_theta = fields.get("compress_rope_theta", 160000.0)
        _, fields["compress_yarn"] = read_rope_part(rope, "compress", compress_theta, max_pos, True)
    return DeepseekV4Config(**fields)


def config_to_hf_dict(config: DeepseekV4Config) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict (nested ``rope_parameters``, every value explicit)."""
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "deepseek_v4"}
    rotary = config.partial_rotary_factor
    out.update({k: getattr(config, k) for k in _INT_FIELDS + _FLOAT_FIELDS})
    out.update(_FIXED)
    out.update(_IGNORED_BY_REFERENCE)
    eos = config.eos_token_id
    out.update(
        layer_types=list(config.layer_types),
        mlp_layer_types=list(config.mlp_layer_types),
        compress_rates={CSA: config.compress_rate_csa, HCA: config.compress_rate_hca},
        partial_rotary_factor=rotary,
        scoring_func=config.scoring_func,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
        pad_token_id=config.pad_token_id,
        rope_parameters={
            "main": rope_part_dict(config.rope_theta, config.main_yarn, rotary),
            "compress": rope_part_dict(config.compress_rope_theta, config.compress_yarn, rotary),
        },
    )
    return out


def read_config_file(path: str | Path) -> DeepseekV4Config:
    """The config a ``config.json`` file holds (``ConfigError`` if it cannot be read)."""
    return config_from_hf_dict(_read_json(Path(path)))


def load_config(directory: str | Path) -> DeepseekV4Config:
    """The config of the checkpoint in ``directory``."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in checkpoint directory {directory}")
    return read_config_file(path)


def checkpoint_architecture(directory: str | Path) -> str:
    """The architecture the checkpoint's ``config.json`` names (``UnsupportedArchitectureError``
    for one this library does not implement); ``ARCHITECTURE`` when the file is missing or
    unreadable, which is left for loading to report."""
    try:
        raw = _read_json(Path(directory) / CONFIG_FILE)
    except ConfigError:
        return ARCHITECTURE
    return architecture_of(raw) if isinstance(raw, dict) else ARCHITECTURE


def checkpoint_dtype_name(directory: str | Path) -> str | None:
    """The dtype the checkpoint's ``config.json`` declares: ``torch_dtype``, or ``dtype`` as
    transformers 5 writes it; ``None`` when neither is a string or the file is missing or
    unreadable (left for loading to report)."""
    try:
        raw = _read_json(Path(directory) / CONFIG_FILE)
    except ConfigError:
        return None
    if not isinstance(raw, dict):
        return None
    names = (raw.get(key) for key in ("torch_dtype", "dtype"))
    return next((name for name in names if isinstance(name, str)), None)


def save_config(directory: str | Path, config: DeepseekV4Config) -> Path:
    """Write ``config`` as the ``config.json`` of ``directory`` (which must exist); its path."""
    path = Path(directory) / CONFIG_FILE
    path.write_text(json.dumps(config_to_hf_dict(config), indent=2) + "\n")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
