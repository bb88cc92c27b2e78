"""Where in the user's code an op was issued: the first Python frame outside torch and graphs.

Capture errors and audit findings name a source line a person can open. The frames of torch
(modules, dispatch modes, operator wrappers) and of this package (the tape, the audit, eager
breaks) are machinery, so the first frame outside both is the line that issued the op. Its
caller follows, since the line that issued the op is often a small helper's body (``x[rows]``
inside ``read_rows``) and the caller's line names what the helper was given.
"""

from __future__ import annotations

import linecache
import os
import sys
from types import CodeType, FrameType

import torch

__all__ = ["user_location"]

_SKIPPED_ROOTS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, __file__)  # torch's package folder, and this one (graphs)
    if path is not None
)
_internal_code: dict[CodeType, bool] = {}  # memo: whether a code object is machinery


def _is_internal(code: CodeType) -> bool:
    internal = _internal_code.get(code)
    if internal is None:
        filename = os.path.abspath(code.co_filename)
        internal = filename.startswith(_SKIPPED_ROOTS) or code.co_filename.startswith("<frozen")
        _internal_code[code] = internal
    return internal


def _user_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None and _is_internal(frame.f_code):
        frame = frame.f_back
    return frame


def user_location(depth: int = 1) -> str:
    """``path:line in function: source`` of the innermost frame outside torch and graphs, then
    ``(called from …)`` with its caller's, when that is outside them too. The search starts
    ``depth`` frames up from this call (2: above the caller, itself machinery)."""
    frame = _user_frame(sys._getframe(depth))
    if frame is None:
        return "<unknown location>"
    caller = frame.f_back
    if caller is None or _is_internal(caller.f_code):
        return _describe(frame)
    return f"{_describe(frame)} (called from {_describe(caller)})"


def _describe(frame: FrameType) -> str:
    code = frame.f_code
    path = os.path.relpath(code.co_filename)
    if path.startswith(".."):
        path = code.co_filename
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    where = f"{path}:{frame.f_lineno} in {code.co_name}"
    return f"{where}: {line}" if line else where
