"""Turning failures into the CLI's one-line errors.

Exit codes: 2 for bad usage (unknown options or names, malformed values, a compute dtype the
platform cannot compute in, a capacity the model or the memory cannot serve, capture sizes a
step cannot carry, a parallel size the model cannot be split into), 1 for everything else the
user can act on (a missing or broken checkpoint, a request that cannot fit, a refused region, a
failed rank), 3 for an internal error (a bug: the message says how to get the traceback).

A reader that closes stdout early (``dsv4 explain | head -1``) is no failure: the command stops
without a word and exits 141, as a shell reports for any writer a closed pipe stopped (128 +
SIGPIPE).
"""

from __future__ import annotations

import os
import select
import sys
import traceback

from dsv4.parallel import ParallelSizeError
from dsv4_isa import KernelIsaError
from graphs.errors import InputError
from platforms.errors import UnknownPlatformError
from runners.capacity import CapacityError
from runners.errors import CaptureSizeError, UnsupportedDtypeError

__all__ = [
    "EXIT_CLOSED_PIPE",
    "EXIT_INTERNAL",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "UsageError",
    "report_failure",
    "stdout_closed",
]

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_CLOSED_PIPE = 141


class UsageError(InputError, ValueError):
    """A malformed command line: the user must change what they typed."""


def _one_line(message: str) -> str:
    return " ".join(message.split())


def report_failure(command: str, exc: BaseException) -> int:
    """Print ``exc`` as one line on stderr and return the exit code for it (an unknown platform
    name is a bad flag value: it can only have come from ``--platform`` or ``DSV4_PLATFORM``)."""
    usage = (
        UsageError,
        UnknownPlatformError,
        UnsupportedDtypeError,
        CapacityError,
        CaptureSizeError,
        KernelIsaError,
    )
    if isinstance(exc, (*usage, ParallelSizeError)):
        code = EXIT_USAGE
    elif isinstance(exc, (ValueError, LookupError, RuntimeError, OSError)):
        code = EXIT_RUNTIME
    else:
        code = EXIT_INTERNAL
    message = _one_line(str(exc)) or type(exc).__name__
    if code == EXIT_INTERNAL:
        message = f"internal error ({type(exc).__name__}): {message} (set DSV4_DEBUG=1 for details)"
    if os.environ.get("DSV4_DEBUG"):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"dsv4 {command}: error: {message}", file=sys.stderr)
    return code


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``poll`` reports an error on its write
    end); if so, stdout is pointed at ``/dev/null`` so that nothing more, the interpreter's last
    flush included, complains about it. Any other broken pipe (a rank's) is a real failure."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # not a real file (captured), or no poll
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone
