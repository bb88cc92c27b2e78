"""Tensor (and expert) parallelism: which rank of how many this process is, and its collectives.

``TensorParallel`` names one rank of a ``torch.distributed`` process group and carries the two
collectives the sharded model needs (``dsv4.model`` says where each one runs):

- ``all_reduce_(tensor)``: the in-place sum over the ranks (after the row-parallel output
  projection, after each MoE, after the vocabulary-parallel embedding lookup);
- ``all_gather(tensor, dim)``: the ranks' tensors concatenated along ``dim`` in rank order (the
  vocabulary-parallel logits).

With one rank both are the identity and issue no op. Under a graph capture they follow the
policy of the step's forward context (``ForwardContext.collectives_in_graph``, a platform
decision): ``True`` calls the collective directly, so a recording CUDA graph captures it with
the rest; ``False`` runs it as an eager break (``graphs.capture.eager_break_during_capture``)
that writes into memory the captured work owns (the all-reduced tensor itself, or the gather
buffer allocated before the break, of a static shape), so the capture audit finds nothing
unstable and every replay re-runs the collective into the same memory. Outside a capture both
policies are the same direct call.

``check_parallel_size(config, size)`` is the one statement of which sizes split the model: the
size must divide the attention heads, the output groups, the routed experts, the shared
expert's intermediate size and the vocabulary (no padding: every logit is a real token).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch
import torch.distributed as dist

from dsv4.config import DeepseekV4Config
from graphs import eager_break_during_capture, get_forward_context
from graphs.errors import InputError

__all__ = [
    "COLLECTIVES",
    "SINGLE",
    "CollectiveClock",
    "ParallelSizeError",
    "TensorParallel",
    "check_parallel_size",
]


class ParallelSizeError(InputError, ValueError):
    """A tensor-parallel size the model cannot be split into (one line naming the field)."""


SPLIT_FIELDS = (
    "num_attention_heads",
    "o_groups",
    "n_routed_experts",
    "moe_intermediate_size",
    "vocab_size",
)
"""Config fields every tensor-parallel size must divide: heads and output groups (attention),
routed experts (expert parallelism), the shared expert's intermediate size (column/row split)
and the vocabulary (embedding and LM head; required to divide rather than padded)."""


def check_parallel_size(config: DeepseekV4Config, size: int) -> None:
    """Raise ``ParallelSizeError`` unless ``size`` is a positive integer dividing every field of
    ``SPLIT_FIELDS`` of ``config``; the message names the first field that does not divide."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ParallelSizeError(f"tensor-parallel size must be a positive integer, got {size!r}")
    for field in SPLIT_FIELDS:
        value = getattr(config, field)
        if value % size:
            raise ParallelSizeError(
                f"tensor-parallel size {size} does not divide {field} ({value}); use a size "
                f"that divides {', '.join(SPLIT_FIELDS)}"
            )


def _collectives_in_graph() -> bool:
    """The step's capture policy for collectives; outside any step there is no capture, and the
    direct call is the plain one."""
    try:
        return get_forward_context().collectives_in_graph
    except RuntimeError:
        return True


@attrs.define
class CollectiveClock:
    """Host seconds spent in this process's collectives, and how many ran (eager calls and
    eager breaks replayed; a collective captured into a device graph runs inside the graph and
    is not seen here). On the CPU a gloo collective returns when it is done, so these are its
    wall time, the wait for the slowest rank included."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


COLLECTIVES = CollectiveClock()
"""This process's clock (``dsv4 bench`` reads it: the share of a step spent in collectives)."""


def _all_reduce(group: Any, tensor: torch.Tensor) -> None:
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    COLLECTIVES.seconds += time.perf_counter() - start
    COLLECTIVES.calls += 1


def _all_gather_into(group: Any, out: torch.Tensor, tensor: torch.Tensor) -> None:
    """``out [size, *tensor.shape]``: row ``r`` is rank ``r``'s ``tensor``."""
    start = time.perf_counter()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor.unsqueeze(0), group=group)
    COLLECTIVES.seconds += time.perf_counter() - start
    COLLECTIVES.calls += 1


_all_reduce_break = eager_break_during_capture(_all_reduce)
_all_gather_break = eager_break_during_capture(_all_gather_into)


@attrs.frozen(kw_only=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` ranks of process group ``group`` (``None``: the default group,
    the one ``torch.distributed`` takes ``None`` to mean; with one rank no collective is issued,
    so no group need exist). Invariant: ``0 <= rank < size``."""

    rank: int
    size: int
    group: Any = None
    """A ``torch.distributed.ProcessGroup``, or ``None`` for the default group."""

    def __attrs_post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ParallelSizeError(
                f"tensor-parallel rank {self.rank} of size {self.size}: need 0 <= rank < size"
            )

    @classmethod
    def from_default_group(cls) -> TensorParallel:
        """This process's rank of the initialised default process group, named as ``None``:
        holding the group object itself would keep it, and its worker threads, alive past
        ``destroy_process_group`` into the interpreter's exit, where a worker releasing a
        finished collective's tensors needs the GIL and aborts the process."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        return cls(rank=dist.get_rank(), size=dist.get_world_size())

    def share(self, total: int) -> range:
        """This rank's contiguous share of ``total`` items (``size`` must divide ``total``)."""
        if total % self.size:
            raise ParallelSizeError(
                f"tensor-parallel size {self.size} does not divide {total} items"
            )
        length = total // self.size
        return range(self.rank * length, (self.rank + 1) * length)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place and return it (see the module docstring)."""
        if self.size == 1:
            return tensor
        if _collectives_in_graph():
            _all_reduce(self.group, tensor)
        else:
            _all_reduce_break(self.group, tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' ``tensor`` (same shape on every rank) concatenated along ``dim`` in rank
        order; the gather writes a ``[size, *shape]`` buffer allocated before it."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty(self.size, *tensor.shape)
        if _collectives_in_graph():
            _all_gather_into(self.group, out, tensor)
        else:
            _all_gather_break(self.group, out, tensor)
        return torch.cat(out.unbind(0), dim=dim)


SINGLE = TensorParallel(rank=0, size=1, group=None)
"""One rank: the whole model, no collectives."""
