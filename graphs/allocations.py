"""Where tensors were allocated, so an audit finding can point at the line that made them.

``AllocationTracker`` is a dispatch mode: while it is active, every op output that does not
alias an input (a new allocation) is remembered with the op and the user's source line. A
runner wraps the code that builds per-step tensors (e.g. attention metadata) in it and hands it
to the capture, whose audit then says where an unstable tensor came from.

Invariants:
- Entries are keyed by storage and hold it weakly: tracking never extends a tensor's life, and
  a key is never reused by another storage while its entry exists.
- Tensors made without a dispatched op (``torch.tensor`` literals are visible as ``lift_fresh``;
  ``torch.from_numpy`` is not) cannot be tracked; their site is unknown.
"""

from __future__ import annotations

from typing import Any

import torch

from graphs._ops import LITERALS, QuietDispatchMode, op_name
from graphs._source import user_location
from graphs._tensor_refs import WeakStorage, storage_key, tensors_of

__all__ = ["AllocationSites", "AllocationTracker", "new_allocations"]


def new_allocations(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
) -> list[torch.Tensor]:
    """The outputs of ``func`` whose storage no input shares (literals count as new)."""
    outs = tensors_of(result)
    if op_name(func) in LITERALS:
        return outs
    inputs = {storage_key(t) for t in tensors_of((args, kwargs))}
    return [o for o in outs if storage_key(o) not in inputs]


class AllocationSites:
    """Storage -> ``"op at file:line"`` for allocations seen; entries die with their storage."""

    def __init__(self) -> None:
        self._sites: dict[int, tuple[WeakStorage, str]] = {}
        self._prune_at = 1024

    def add(self, tensor: torch.Tensor, site: str) -> None:
        key = storage_key(tensor)
        if key not in self._sites:
            self._sites[key] = (WeakStorage(tensor.untyped_storage()), site)
        if len(self._sites) >= self._prune_at:
            self._sites = {k: v for k, v in self._sites.items() if not v[0].expired()}
            self._prune_at = max(1024, 2 * len(self._sites))

    def discard(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor``'s storage (if it was added)."""
        self._sites.pop(storage_key(tensor), None)

    def site_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._sites.get(storage_key(tensor))
        return None if entry is None else entry[1]


class AllocationTracker(QuietDispatchMode):
    """Dispatch mode that records the allocation site of every tensor made while it is active.

    Use ``with tracker: build_metadata()``; it may be entered again later and accumulates.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites = AllocationSites()

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = func(*args, **kwargs)
        allocated = new_allocations(func, args, kwargs, result)
        if allocated:
            site = f"{func} at {user_location()}"
            for t in allocated:
                self.sites.add(t, site)
        return result

    def site_of(self, tensor: torch.Tensor) -> str | None:
        """``"op at file:line"`` where ``tensor``'s storage was allocated, if it was tracked."""
        return self.sites.site_of(tensor)
