"""Exception types of the engine; each message is one line a person can act on.

Every error raised for bad input is raised before the engine's state changes, so requests that are
already running are never affected by a rejected one and the engine stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runners.engine.request import RequestOutput

__all__ = [
    "EngineConfigError",
    "EngineError",
    "ExecutorError",
    "InvalidRequestError",
    "RequestFailedError",
    "RequestTooLongError",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class EngineConfigError(EngineError, ValueError):
    """The engine was built with impossible settings (a non-positive budget or cache size)."""


class InvalidRequestError(EngineError, ValueError):
    """A request was refused: empty prompt, a token id outside the vocabulary, bad sampling
    parameters, or a request id that is already live."""


class RequestTooLongError(InvalidRequestError):
    """A request can never fit: its prompt plus generated tokens exceed one block-table row (the
    maximum context) or every KV block of the cache together."""


class ExecutorError(EngineError, RuntimeError):
    """The step executor broke its contract (logits of the wrong shape or dtype)."""


class RequestFailedError(EngineError, RuntimeError):
    """Requests of one ``LLM.generate`` call failed: their next token could not be sampled (the
    model gave NaN or inf logits, say). Raised once every request of the call has finished, so
    the others ran to completion: ``outputs`` holds all of them in prompt order, the failed ones
    with ``FinishReason.ERROR`` and their ``error``; ``failed`` holds only those."""

    def __init__(self, outputs: Sequence[RequestOutput]) -> None:
        self.outputs = list(outputs)
        self.failed = [o for o in self.outputs if o.error is not None]
        more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        finished = len(self.outputs) - len(self.failed)
        super().__init__(
            f"{self.failed[0].error}{more}; {finished} of the call's {len(self.outputs)} "
            "requests finished normally"
        )
