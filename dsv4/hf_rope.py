"""The RoPE parts of a Hugging Face ``config.json``: one ``rope_parameters`` part to a rotary base
and YaRN scaling, and back (used by ``dsv4.hf_config``).

Reading follows transformers 5.23.0 where it changes the numbers: a part's ``rope_type`` is
``default`` or ``yarn``; a flat part (the legacy single dict) keeps the theta it is given and
gets ``attention_factor`` 1.0 unless it names one; a nested part without ``attention_factor``
derives it from ``factor`` (and ``mscale``/``mscale_all_dim``) as YaRN does. The correction
range is always truncated, as in the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dsv4.config import YarnScaling
from dsv4.errors import ConfigError

__all__ = ["read_rope_part", "rope_part_dict"]


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(part: Mapping[str, Any], label: str, max_pos: int, flat: bool) -> YarnScaling:
    where = f"rope_parameters[{label!r}]"
    if part.get("truncate", True) is not True:
        raise ConfigError(f"{where}: truncate=false is not supported (the reference truncates)")
    factor = part.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise ConfigError(f"{where}: YaRN needs a numeric 'factor', got {factor!r}")
    original = part.get("original_max_position_embeddings") or max_pos
    if isinstance(original, bool) or not isinstance(original, int):
        raise ConfigError(f"{where}: original_max_position_embeddings must be an integer")
    attention = part.get("attention_factor")
    if attention is None:
        mscale, mscale_all = part.get("mscale"), part.get("mscale_all_dim")
        if flat:
            attention = 1.0
        elif mscale and mscale_all:
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all)
        else:
            attention = _mscale(factor)
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(part.get("beta_fast") or 32),
        beta_slow=float(part.get("beta_slow") or 1),
        attention_factor=float(attention),
    )


def read_rope_part(
    part: Mapping[str, Any], label: str, theta: float, max_pos: int, flat: bool
) -> tuple[float, YarnScaling | None]:
    if not isinstance(part, Mapping):
        raise ConfigError(f"rope_parameters[{label!r}] must be a dict, got {part!r}")
    rope_type = part.get("rope_type", part.get("type", "default"))
    theta = float(part.get("rope_theta", theta)) if not flat else theta
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn(part, label, max_pos, flat)
    raise ConfigError(
        f"rope_parameters[{label!r}]: rope_type {rope_type!r} is not supported "
        "(supported: 'default', 'yarn')"
    )


def rope_part_dict(theta: float, yarn: YarnScaling | None, prf: float) -> dict[str, Any]:
    part: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": prf,
    }
    if yarn is not None:
        part.update(
            rope_type="yarn",
            factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            attention_factor=yarn.attention_factor,
        )
    return part
