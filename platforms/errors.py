"""Exception types of platform lookup and discovery; each message says what to do next."""

from __future__ import annotations

from graphs.errors import InputError

__all__ = [
    "AmbiguousPlatformError",
    "PlatformError",
    "PlatformPluginError",
    "PlatformRegistrationError",
    "PlatformUnavailableError",
    "UnknownPlatformError",
]


class PlatformError(InputError, RuntimeError):
    """Base of every platform error (a name, plugin or machine the caller can change)."""


class UnknownPlatformError(PlatformError, LookupError):
    """A platform name that no built-in, registered or plugin platform carries."""


class PlatformUnavailableError(PlatformError):
    """A platform asked to run on a machine that lacks its device (simulate it instead)."""


class PlatformPluginError(PlatformError):
    """An out-of-tree platform plugin failed to load or does not provide a valid platform."""


class PlatformRegistrationError(PlatformError):
    """A platform registered under a name that is already taken, or not a ``Platform``."""


class AmbiguousPlatformError(PlatformError):
    """More than one plugin platform is available and nothing says which one to use."""
