"""Exception types of the engine; each message is one line a person can act on.

Every error raised for bad input is raised before the engine's state changes, so requests that are
already running are never affected by a rejected one and the engine stays usable. A failed request
is reported with its output: ``RequestFailedError`` lives beside ``RequestOutput`` in ``request``.
"""

from __future__ import annotations

from graphs.errors import InputError

__all__ = [
    "EngineConfigError",
    "EngineError",
    "ExecutorError",
    "InvalidRequestError",
    "RequestTooLongError",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class EngineConfigError(EngineError, InputError, ValueError):
    """The engine was built with impossible settings (a non-positive budget or cache size)."""


class InvalidRequestError(EngineError, InputError, ValueError):
    """A request was refused: empty prompt, a token id outside the vocabulary, bad sampling
    parameters, or a request id that is already live."""


class RequestTooLongError(InvalidRequestError):
    """A request can never fit: its prompt plus generated tokens exceed one block-table row (the
    maximum context) or every KV block of the cache together."""


class ExecutorError(EngineError, RuntimeError):
    """The step executor broke its contract (logits of the wrong shape or dtype)."""
