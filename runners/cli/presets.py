"""Named model-size presets for the built-in model and ``init-checkpoint``."""

from __future__ import annotations

from dsv4 import DeepseekV4Config
from runners.cli.errors import UsageError

__all__ = ["PRESETS", "preset_config"]

PRESETS = ("tiny", "small")


def preset_config(name: str) -> DeepseekV4Config:
    """The configuration of preset ``name``; unknown names are a usage error."""
    if name == "tiny":
        return DeepseekV4Config.tiny()
    if name == "small":
        return DeepseekV4Config.small()
    raise UsageError(f"unknown preset {name!r}; expected one of: {', '.join(PRESETS)}")
