"""References to storages that do not pin memory, and the tensors inside values.

``tensors_of`` finds the tensors of an op's arguments or results (lists, tuples and dicts: all an
op takes; it runs for every op recorded), ``map_tensors`` those of any Python value (eager-break
arguments: named tuples and attrs instances too).

Every dispatch mode of ``graphs`` tells memory apart by storage, not by tensor: views share their
base's storage, and a storage outlives the tensor objects over it.

Invariant: a storage is identified by its ``StorageImpl`` address (``storage_key``). Holding a
``WeakStorage`` keeps that address from being reused while the reference lives, so keys
recorded during one segment never collide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import attrs
import torch

__all__ = ["WeakStorage", "map_tensors", "storage_key", "tensors_of"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the address of its ``StorageImpl``)."""
    return int(t.untyped_storage()._cdata)


class WeakStorage:
    """A weak reference to a storage: tells whether it is still in use, and revives it if so."""

    __slots__ = ("cdata",)
    _free: ClassVar = staticmethod(torch.UntypedStorage._free_weak_ref)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata = cast(int, storage._weak_ref())

    def expired(self) -> bool:
        """True when no tensor or storage object uses the storage any more."""
        return bool(torch.UntypedStorage._expired(self.cdata))

    def get(self) -> torch.UntypedStorage | None:
        """A strong reference to the storage, or ``None`` if it expired."""
        return cast(
            "torch.UntypedStorage | None", torch.UntypedStorage._new_with_weak_ptr(self.cdata)
        )

    def __del__(self) -> None:
        cdata = getattr(self, "cdata", None)  # unset when an interrupt (Ctrl-C) cut __init__
        if cdata is not None:
            self._free(cdata)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or lists, tuples and dict values of them), in order."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    # One shared accumulator: called once per op argument, so no per-level list building.
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (list, tuple, dict)):
                _collect(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)``, through tuples (named ones
    too), lists, dict values and attrs instances (their ``__init__`` fields), each rebuilt as its
    type; any other value is kept as it is. ``fn`` sees the tensors in order, depth first."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if attrs.has(type(value)):
        fields = [f for f in attrs.fields(type(value)) if f.init]
        return attrs.evolve(
            value, **{f.alias: map_tensors(getattr(value, f.name), fn) for f in fields}
        )
    return value
