"""References to the tensors a tape segment records, and tensors rebuilt from them.

A tape records a reference to every tensor an op touches. Tensors allocated inside the segment
are held weakly, so the program frees intermediates as it would eagerly (capture-time memory is
eager memory) and the tape learns at the end which storages no one else can see. Tensors from
outside the segment are held strongly: replay needs them and they are alive anyway.

Invariant: a ``TensorRef`` snapshots the tensor's view metadata (size, stride, offset) at the op
that used it; in-place view ops (``transpose_``, ``unsqueeze_``, an ``out=`` resize) change a
tensor's metadata later, and replay must use the metadata each op saw.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphs._tensor_refs import storage_key

__all__ = ["TensorRef", "alias", "map_leaves", "same_view"]


class TensorRef:
    """One recorded use of a tensor: the tensor (strongly or weakly) and its view metadata."""

    __slots__ = ("dtype", "key", "offset", "size", "stride", "strong", "weak")

    def __init__(self, t: torch.Tensor, *, weak: bool, key: int) -> None:
        """``key`` is ``storage_key(t)``, which the caller has already computed."""
        self.strong: torch.Tensor | None = None if weak else t
        self.weak: weakref.ref[torch.Tensor] | None = weakref.ref(t) if weak else None
        self.key = key
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = int(t.storage_offset())
        self.dtype = t.dtype

    def tensor(self) -> torch.Tensor | None:
        """The recorded tensor object, or ``None`` if it was weakly held and is gone."""
        return self.strong if self.weak is None else self.weak()


def same_view(t: torch.Tensor, ref: TensorRef) -> bool:
    """True when ``t`` still has the storage and view metadata ``ref`` recorded."""
    return (
        t.storage_offset() == ref.offset
        and tuple(t.size()) == ref.size
        and tuple(t.stride()) == ref.stride
        and storage_key(t) == ref.key
    )


def alias(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """A new tensor over ``storage`` with the given view metadata (offset in elements)."""
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage, offset, size, stride)
    return t


def map_leaves(fn: Callable[[Any], Any], value: Any, kind: type) -> Any:
    """``value`` with every ``kind`` instance ``x`` replaced by ``fn(x)``, through lists,
    tuples and dict values (an op's arguments nest no deeper than a list of tensors)."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)([_map_item(fn, v, kind) for v in value])
    if isinstance(value, dict):
        return {k: _map_item(fn, v, kind) for k, v in value.items()}
    return value


def _map_item(fn: Callable[[Any], Any], value: Any, kind: type) -> Any:
    # Leaves are decided here without a call: ops' arguments are mostly flat.
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple, dict)):
        return map_leaves(fn, value, kind)
    return value
