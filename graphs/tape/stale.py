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
  capture-time replay is the first and only run of those writes).
- Constants (factory outputs the tape keeps and never replays) are left as they are: every
  replay would give them the same value.
"""

from __future__ import annotations

import torch

from graphs._tensor_refs import storage_key
from graphs.tape.refs import alias

__all__ = ["OutsideWrites", "fill_junk", "junk_value"]


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


class OutsideWrites:
    """Storages from outside a recording segment that its ops wrote, with their prior bytes."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def save(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s storage bytes as they are now, unless already kept."""
        key = storage_key(tensor)
        if key not in self._saved:
            storage = tensor.untyped_storage()
            self._saved[key] = (storage, storage.clone())

    def restore(self) -> None:
        """Give every kept storage its saved bytes back and forget them."""
        for storage, saved in self._saved.values():
            storage.copy_(saved)
        self._saved.clear()
