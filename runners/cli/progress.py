"""Progress lines on stderr, shown only when stderr is a terminal (never in redirected logs, never
with ``--json``): each phase is one ``tqdm`` line, its message and its elapsed time rewritten in
place, ended by ``done``."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Draws status lines on stderr while enabled; silent otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._line: tqdm[Any] | None = None

    @classmethod
    def for_terminal(cls, *, json_output: bool) -> Progress:
        return cls(enabled=sys.stderr.isatty() and not json_output)

    def update(self, message: str) -> None:
        """Show ``message`` on the current phase's line (opened on first use)."""
        if not self.enabled:
            return
        if self._line is None:
            self._line = tqdm(desc=message, file=sys.stderr, bar_format="{desc} [{elapsed}]")
        else:
            self._line.set_description_str(message)

    def done(self, message: str) -> None:
        """Show ``message`` and end the phase's line."""
        if not self.enabled:
            return
        self.update(message)
        assert self._line is not None
        self._line.close()
        self._line = None
