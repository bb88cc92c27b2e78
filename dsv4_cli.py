"""The ``dsv4`` console entry point: one line on Ctrl-C at any moment, start-up included.

Importing the CLI imports torch and the whole library, which takes seconds; a Ctrl-C then
would print a long traceback from inside the import machinery. This module imports nothing
heavy itself, so it can catch the interrupt wherever it lands — while importing, resolving,
capturing, generating or printing — and turn it into one line on stderr and exit code 130.
During the start-up imports the interrupt exits at once from a signal handler: some imported
libraries run ``except:`` clauses that would swallow a ``KeyboardInterrupt`` raised there.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["main"]

EXIT_INTERRUPTED = 130


def main() -> int:
    """Run ``dsv4`` with the process's arguments; return its exit code."""
    named = len(sys.argv) > 1 and not sys.argv[1].startswith("-")
    line = f"{'dsv4 ' + sys.argv[1] if named else 'dsv4'}: interrupted\n"

    def exit_at_once(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write(line)
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if interruptible:
        signal.signal(signal.SIGINT, exit_at_once)
    try:
        from runners.cli.main import main as run_cli

        if interruptible:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return run_cli(sys.argv[1:])
    except KeyboardInterrupt:
        sys.stderr.write(line)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
