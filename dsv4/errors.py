"""Exception types of the DeepSeek-V4 package; each message is one actionable line."""

from __future__ import annotations

from graphs.errors import InputError

__all__ = ["CheckpointError", "ConfigError", "TensorValueError"]


class ConfigError(InputError, ValueError):
    """A configuration value the model cannot run with (names the field and the allowed values)."""


class CheckpointError(InputError, ValueError):
    """A checkpoint that cannot be loaded: a missing, unexpected, mis-shaped or quantised tensor
    (named in the message), or a missing/unreadable file."""


class TensorValueError(CheckpointError):
    """A tensor of the right name, dtype and shape whose values the model cannot run with."""

    def __init__(self, tensor: str, file: str, reason: str) -> None:
        self.tensor = tensor
        self.file = file
        self.reason = reason
        super().__init__(f"tensor {tensor!r} in {file} {reason}")
