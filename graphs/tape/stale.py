"""What recording leaves behind on the tape: junk in produced memory, outside memory untouched.

Under CUDA stream capture a segment's kernels are recorded, not run: right after capture the
tensors the segment produced hold whatever bytes their pool held, and memory from outside the
segment that its kernels write still holds what it held before. The tape must run every op while
it records (the next op needs real outputs), so when a segment ends it puts memory back the way
CUDA would leave it.

Invariants:
- Every storage the segment allocated that the program still holds is filled with junk until a
  replay writes it: NaN for floating and complex dtypes, the dtype's largest value for integers
  (an index out of range of any table, so indexing with it fails loudly) and ``True`` for bool.
- Every storage from outside the segment that a recorded op wrote gets back the bytes it held
  before the segment's first write to it, so only replays ever change it (as on CUDA, where the
  capture-time replay is the first and only run of those writes). Only the bytes written are
  kept where the op names them (``written_rows``), so a write of one row into a large cache
  costs one row, not the cache.
- Constants (factory outputs the tape keeps and never replays) are left as they are: every
  replay would give them the same value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from graphs._tensor_refs import storage_key
from graphs.tape.refs import alias

__all__ = ["OutsideWrites", "fill_junk", "junk_value", "register_row_writes", "written_rows"]


def junk_value(dtype: torch.dtype) -> float | int | bool:
    """The value a produced tensor of ``dtype`` holds between recording and its first replay."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return int(torch.iinfo(dtype).max)


def fill_junk(storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
    """Fill every whole ``dtype`` element of ``storage`` with ``junk_value(dtype)``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = storage.nbytes() // itemsize
    if count:
        alias(storage, dtype, 0, (count,), (1,)).fill_(junk_value(dtype))


RowsOf = Callable[..., tuple[int, torch.Tensor]]
"""Given an op's arguments, the slices of its first argument it writes: ``(dim, index)``."""

_ROW_WRITERS: dict[Any, RowsOf] = {}


def register_row_writes(op: torch._ops.OpOverload, rows_of: RowsOf) -> None:
    """Declare that ``op`` (a project's operator) writes only the slices ``rows_of(*args)`` of
    its first argument, as ``index_copy_`` does: a recording segment then logs those slices of
    an outside tensor it writes, not its whole storage (a KV cache of tens of MiB)."""
    _ROW_WRITERS[op] = rows_of


def written_rows(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, torch.Tensor] | None:
    """``(dim, index)`` when ``func`` writes only the slices ``index`` of ``args[0]`` along
    ``dim`` (``index_copy_``, or an operator registered with ``register_row_writes``: a
    KV-cache write names the rows it writes), else ``None``."""
    rows_of = _ROW_WRITERS.get(func)
    if rows_of is not None and not kwargs:
        return rows_of(*args)
    if func is not torch.ops.aten.index_copy_.default or kwargs or len(args) != 4:
        return None
    dim, index = args[1], args[2]
    if not isinstance(dim, int) or not isinstance(index, torch.Tensor):
        return None
    return dim, index


class OutsideWrites:
    """An undo log of the writes a recording segment made to storages from outside it.

    Each write is logged, before it runs, by the bytes it is about to change: the slices an
    ``index_copy_`` names (``written_rows``: a few rows of a large cache), else the whole
    storage, once (a storage whose whole bytes are kept needs nothing more logged). ``restore``
    undoes the log newest first, so every storage ends as it was before the segment's first
    write to it, whatever the order and overlap of the writes.
    """

    def __init__(self) -> None:
        self._log: list[Callable[[], object]] = []
        self._whole: set[int] = set()

    def save(self, tensor: torch.Tensor, rows: tuple[int, torch.Tensor] | None = None) -> None:
        """Log the bytes of ``tensor`` a write is about to change: the slices ``rows``
        (``(dim, index)``) of it, or its whole storage."""
        key = storage_key(tensor)
        if key in self._whole:
            return
        if rows is not None:
            dim, index = rows
            index = index.clone()
            before = tensor.index_select(dim, index)
            self._log.append(functools.partial(tensor.index_copy_, dim, index, before))
            return
        storage = tensor.untyped_storage()
        self._whole.add(key)
        self._log.append(functools.partial(storage.copy_, storage.clone()))

    def restore(self) -> None:
        """Undo every logged write, newest first, and forget them."""
        for undo in reversed(self._log):
            undo()
        self._log.clear()
        self._whole.clear()
