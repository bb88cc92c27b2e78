"""Reading safetensors shards lazily, keeping few of their pages resident.

``safe_open`` memory-maps a file and hands out tensors that view the map: reading one makes
resident only the pages it covers, but those pages stay in the process's resident set until the
handle and every view of it are gone. ``ShardReader`` bounds that:

- built over a checkpoint's files, it lists every tensor from the headers alone (``entries``:
  dtype, shape and stored bytes of each key); a file that cannot be read is one-line
  ``CheckpointError`` naming it, and a truncated one says so (the bytes of tensor data its header
  describes, and the bytes the file holds);
- ``read`` serves a view of a whole tensor or of an index (``index_chunks`` plans them), to be
  copied and dropped before the next read: once ``budget`` bytes were served through its open
  handles it closes them, so about ``budget`` bytes of file pages plus the piece being read are
  resident at any time, whatever the size of the checkpoint;
- it is a context manager closing its handles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import torch
from safetensors import safe_open

from dsv4.errors import CheckpointError

__all__ = ["Entry", "Index", "ShardReader", "Stored", "element_bits", "index_chunks"]

Index = tuple[int | slice, ...]
"""An index into a tensor: an integer or a slice per dimension (``index_chunks`` makes integers
for leading dimensions, then at most one slice; a tensor-parallel part slices any one)."""

_ELEMENT_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_MAX_HEADER = 100_000_000
"""The largest header safetensors reads (bytes); a length prefix above it is not truncation."""


def element_bits(dtype: str) -> int:
    """Bits per element of safetensors dtype ``dtype`` (``F32`` -> 32, ``F8_E4M3`` -> 8)."""
    if dtype in _ELEMENT_BITS:
        return _ELEMENT_BITS[dtype]
    digits = "".join(c for c in dtype.split("_")[0] if c.isdigit())
    return int(digits) if digits else 8  # BOOL


@attrs.frozen
class Stored:
    """Where a tensor is stored: its key as the file names it, and the file."""

    path: Path
    key: str


@attrs.frozen
class Entry:
    """One stored tensor as its file's header describes it."""

    stored: Stored
    dtype: str
    """The safetensors dtype name (``F32``, ``BF16``, ``F8_E4M3`` ...)."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.shape) * element_bits(self.dtype) / 8)


def index_chunks(shape: Sequence[int], element_bytes: float, budget: int) -> Iterator[Index]:
    """Indices covering a tensor of ``shape`` in order, each of at most ``budget`` bytes (of
    ``element_bytes`` per element) where a single element allows: runs of whole rows of the
    first dimension, or, where one row is over the budget, each row's own chunks."""
    if not shape:
        yield ()
        return
    row = math.prod(shape[1:]) * element_bytes
    if len(shape) == 1 or row <= budget:
        step = max(1, int(budget // max(row, 1)))
        for start in range(0, shape[0], step):
            yield (slice(start, min(start + step, shape[0])),)
        return
    for i in range(shape[0]):
        for rest in index_chunks(shape[1:], element_bytes, budget):
            yield (i, *rest)


class ShardReader:
    """Lazy, page-bounded access to the tensors of ``files`` (see the module docstring)."""

    def __init__(self, files: Sequence[Path], *, budget: int) -> None:
        self.budget = budget
        self.entries: dict[Stored, Entry] = {}
        self._handles: dict[Path, Any] = {}
        self._served = 0
        for path in files:
            with self._open(path) as handle:
                for key in handle.keys():  # noqa: SIM118
                    piece = handle.get_slice(key)
                    stored = Stored(path, key)
                    shape = tuple(piece.get_shape())
                    self.entries[stored] = Entry(stored, piece.get_dtype(), shape)

    def read(self, stored: Stored, index: Index = ()) -> torch.Tensor:
        """``stored``'s tensor, or its ``index``: a view of the mapped file. Copy what you keep
        and drop the view before the next read, which may close its handle: a view outliving
        its handle stays valid but keeps its pages resident."""
        if self._served >= self.budget:
            self.close()
        if stored.path not in self._handles:
            self._handles[stored.path] = self._open(stored.path)
        handle = self._handles[stored.path]
        piece = handle.get_slice(stored.key)[index] if index else handle.get_tensor(stored.key)
        self._served += piece.numel() * piece.element_size()
        return piece

    def close(self) -> None:
        """Close every handle (the pages they mapped leave the resident set with their views)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._served = 0

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def _open(path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:
            reason = _truncation(path) or str(exc).splitlines()[0]
            raise CheckpointError(f"cannot read {path.name}: {reason}") from None


def _truncation(path: Path) -> str | None:
    """How ``path`` is truncated, when it is a safetensors file cut short; else ``None``."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                return None
            length = int.from_bytes(prefix, "little")
            if length > _MAX_HEADER or not file.read(1).startswith(b"{"):
                return None
            if 8 + length > size:
                return (
                    f"the file is truncated (its header is {length} bytes, the file holds "
                    f"{size - 8} after the 8-byte header length)"
                )
            file.seek(8)
            header = json.loads(file.read(length))
        ends = [
            int(entry["data_offsets"][1])
            for name, entry in header.items()
            if name != "__metadata__"
        ]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    described, held = max(ends, default=0), size - 8 - length
    if held >= described:
        return None
    return (
        f"the file is truncated (its header describes {described} bytes of tensor data, the "
        f"file holds {held})"
    )
