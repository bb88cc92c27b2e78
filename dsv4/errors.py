"""Exception types of the DeepSeek-V4 package; each message is one actionable line."""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value the model cannot run with (names the field and the allowed values)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: a missing, unexpected, mis-shaped or quantised tensor
    (named in the message), or a missing/unreadable file."""
