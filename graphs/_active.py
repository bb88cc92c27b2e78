"""The thread-local active capture: the one piece of state shared by capture and eager breaks.

Invariant: at most one capture is active per thread; ``activate`` refuses a second, and the
capture always calls ``deactivate`` when its context exits, normally or by exception.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from graphs.errors import CaptureError

if TYPE_CHECKING:
    from graphs.capture import BreakableCapture

_state = threading.local()


def current() -> BreakableCapture | None:
    """The capture active in this thread, or ``None``."""
    return getattr(_state, "capture", None)


def activate(capture: BreakableCapture) -> None:
    if current() is not None:
        raise CaptureError(
            "a breakable capture is already active in this thread; captures cannot be nested"
        )
    _state.capture = capture


def deactivate(capture: BreakableCapture) -> None:
    if current() is capture:
        _state.capture = None
