"""``eager_break_during_capture``: mark a function as an eager break of a breakable capture.

Invariants (DESIGN §4):
- Outside a capture the decorated function is a plain call.
- Inside a capture whose current segment is capturing, the call ends that graph segment, runs the
  function for real, records it as an eager segment (re-run on every replay with the same
  arguments) and begins a new graph segment.
- Inside an eager segment (the capture is not capturing) and inside a FULL capture the function
  runs inline: a break nested in a wider eager region costs nothing and runs again on every
  replay through the outer one; under FULL its work is captured like any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from graphs import _active

__all__ = ["eager_break_during_capture"]

R = TypeVar("R")


def eager_break_during_capture(fn: Callable[..., R]) -> Callable[..., R]:
    """Decorate ``fn`` so that it becomes an eager segment when called while capturing."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        capture = _active.current()
        if capture is None or not capture.breaks_here():
            return fn(*args, **kwargs)
        return capture.add_eager(fn, args, kwargs)

    wrapper.__eager_break__ = True  # type: ignore[attr-defined]
    return wrapper
