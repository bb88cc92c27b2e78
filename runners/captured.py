"""One captured step, and the static memory a runner declares to the capture audit.

Invariants:
- A step is captured under a forward context with *dummy* metadata — every token is padding
  (slot -1), so the capture writes nothing into the KV caches — built under an
  ``AllocationTracker``, so an audit finding about a metadata tensor names the line that
  allocated it. The context carries the runner's caches and eager region, as every step's does.
- The static memory of a runner is its input buffers, its KV caches, its persistent metadata (V2
  only) and every parameter and buffer of the model, each registered under a readable name.
- The step runs once eagerly first, through ``backend.warm_up`` (on CUDA on the capture stream,
  so lazily created library workspaces land outside the graph pool; on the CPU tape as well, so
  that whatever the warm-up leaves behind is audited as it is on the GPU), as a step of its own
  with a context of its own: a value the warm-up shares within its step is not the capture's.
- ``CapturedGraph.logits`` is the tensor the capture's last segment writes; it holds junk right
  after capture (recording is not execution), is valid right after ``replay()``, and may be
  overwritten by any later replay on the same pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import torch

from graphs.allocations import AllocationTracker
from graphs.audit import AuditMode, AuditReport
from graphs.backend import GraphBackend
from graphs.capture import BreakableCapture
from graphs.forward_context import ForwardContext, forward_context
from graphs.static_memory import StaticMemory
from runners.batch import GraphKey
from runners.modes import CUDAGraphMode

__all__ = ["CapturedGraph", "capture_step", "static_memory"]


@attrs.frozen(kw_only=True)
class CapturedGraph:
    """One captured step: the capture to replay, the logits it writes, its audit report."""

    key: GraphKey
    """The mode, padded token count and context width the graph serves."""
    capture: BreakableCapture
    logits: torch.Tensor

    @property
    def audit(self) -> AuditReport:
        return self.capture.audit_report


def static_memory(
    model: torch.nn.Module,
    *,
    inputs: dict[str, torch.Tensor],
    kv_caches: Iterable[torch.Tensor],
    metadata: dict[str, torch.Tensor],
) -> StaticMemory:
    """The memory captured work may read at fixed addresses, each under a readable name."""
    static = StaticMemory()
    static.register_module(model)
    for name, tensor in (*inputs.items(), *metadata.items()):
        static.register(tensor, name)
    static.register_many(kv_caches, "kv_cache")
    return static


def capture_step(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    key: GraphKey,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    dummy_context: Callable[[], ForwardContext],
    backend: GraphBackend,
    static: StaticMemory,
    audit: AuditMode,
) -> CapturedGraph:
    """Capture ``model(input_ids, positions)`` under ``key.mode`` with dummy metadata.

    ``dummy_context`` fills the positions and returns the step's context with all-padding
    metadata ``key.width`` blocks wide; ``input_ids`` holds ``key.num_tokens`` tokens.
    """
    input_ids.zero_()
    # the warm-up is a step of its own, with a context of its own: values it shares within its
    # step (``ForwardContext.once``) live outside the capture and must not reach it
    with forward_context(dummy_context()), torch.inference_mode():
        backend.warm_up(lambda: model(input_ids, positions))
    tracker = AllocationTracker()
    with tracker:
        ctx = dummy_context()
    with (
        forward_context(ctx),
        torch.inference_mode(),
        BreakableCapture(
            backend,
            full=key.mode is CUDAGraphMode.FULL,
            static=static,
            audit=audit,
            allocations=tracker,
        ) as capture,
    ):
        logits = model(input_ids, positions)
    return CapturedGraph(key=key, capture=capture, logits=logits)
