"""Progress lines on stderr, shown only when stderr is a terminal (never in redirected logs)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """Writes ``\\r``-updated status lines to stderr while enabled; silent otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._started = time.perf_counter()
        self._open_line = False

    @classmethod
    def for_terminal(cls, *, json_output: bool) -> Progress:
        return cls(enabled=sys.stderr.isatty() and not json_output)

    def update(self, message: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._started
        sys.stderr.write(f"\r\033[K{message} [{elapsed:.1f}s]")
        sys.stderr.flush()
        self._open_line = True

    def done(self, message: str) -> None:
        if not self.enabled:
            return
        self.update(message)
        sys.stderr.write("\n")
        sys.stderr.flush()
        self._open_line = False
