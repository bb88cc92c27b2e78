"""Breakable graph capture: eager-region strategies, captures, backends and audits.

Imports torch only; never resolves a platform. ``graphs/tape/`` is the CPU op tape; every other
module is one concept (``capture``, ``strategies``, ``audit``, ``cuda_backend``, ...).
"""

from graphs.allocations import AllocationTracker
from graphs.audit import AuditFinding, AuditMode, AuditReport
from graphs.capture import BreakableCapture, eager_break_during_capture
from graphs.cuda_backend import CudaGraphBackend
from graphs.errors import BackendUnavailableError, CaptureAuditError, CaptureError, InputError
from graphs.forward_context import ForwardContext, forward_context, get_forward_context
from graphs.static_memory import StaticMemory
from graphs.strategies import (
    STRATEGIES,
    EagerRegionStrategy,
    FullGraph,
    NarrowRegion,
    NoGraph,
    WideRegion,
    strategy_from_name,
)
from graphs.tape import TapeBackend

__all__ = [
    "STRATEGIES",
    "AllocationTracker",
    "AuditFinding",
    "AuditMode",
    "AuditReport",
    "BackendUnavailableError",
    "BreakableCapture",
    "CaptureAuditError",
    "CaptureError",
    "CudaGraphBackend",
    "EagerRegionStrategy",
    "ForwardContext",
    "FullGraph",
    "InputError",
    "NarrowRegion",
    "NoGraph",
    "StaticMemory",
    "TapeBackend",
    "WideRegion",
    "eager_break_during_capture",
    "forward_context",
    "get_forward_context",
    "strategy_from_name",
]
