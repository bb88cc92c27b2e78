"""The capture a runner records into: its backend, with the runner's static memory declared.

Every tensor captured work reads and did not produce must be a model parameter or buffer or be
registered here as static (input buffers, persistent metadata, KV caches); the audit reports any
other read — the seed's bug caught at capture time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphs.capture import BreakableCapture

if TYPE_CHECKING:
    from runners.base import ModelRunner

__all__ = ["audited_capture"]


def audited_capture(runner: ModelRunner, *, full: bool) -> BreakableCapture:
    """A capture on the runner's backend; audited when ``runner.audit`` is set."""
    return BreakableCapture(runner._backend, full=full)
