"""Exception types of the capture machinery; each carries a reason a person can act on."""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "CaptureAuditError", "CaptureError", "InputError"]


class InputError(Exception):
    """Bad input to the library: a value, a file or a choice the caller can fix.

    The base of every bad-input error of every package (it lives at the ground floor so that
    ``platforms``, ``dsv4`` and ``runners`` can all derive from it); its message is one line
    naming what was wrong. Each subclass keeps its builtin kind too (``ValueError``,
    ``LookupError``, ``RuntimeError``), so ``except ValueError`` still catches what it did. What
    is not the caller's input (a capture misuse, a failed rank, a broken executor) is not one.
    """


class CaptureError(RuntimeError):
    """An operation that cannot be captured or replayed correctly, or a misuse of a capture.

    Raised for host syncs, data-dependent output shapes and random ops inside a captured
    segment (naming the op and the user's source line), for a nested capture in one thread, and
    for replaying a capture that is empty or failed.
    """


class CaptureAuditError(CaptureError):
    """A captured segment read memory that is not stable across replays.

    Such memory was neither produced inside the capture, nor a parameter or buffer of a module,
    nor registered as static; replay would read whatever it holds then (the seed's bug).
    """


class BackendUnavailableError(RuntimeError):
    """A graph backend was asked for on a machine that cannot run it (e.g. CUDA without a GPU)."""
