"""A step's logits from rank 0 to the driving process through shared memory, not a pipe.

Logits are ``rows x vocab`` float32: 8 MiB for 16 rows of a 129k vocabulary, which took 13 ms
one way pickled through a pipe on the 2-core development machine, against 0.5 ms for a copy.
So ``launch_engine``'s driver creates one file of ``max_rows x vocab`` float32 in shared memory
(``/dev/shm`` where there is one), rank 0 maps it too, and the driver removes the file's name as
soon as both have mapped it: the memory lives as long as a mapping does, and nothing is left
behind however either process ends. Each step rank 0 writes its logits into the leading rows
and replies with their count; the driver returns a copy (the next step overwrites them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile

import torch

__all__ = ["SharedLogits", "shared_memory_dir"]


def shared_memory_dir() -> str | None:
    """``/dev/shm`` when this machine has a writable one (memory, not disk); else ``None``, the
    temporary directory."""
    candidate = "/dev/shm"
    return candidate if os.path.isdir(candidate) and os.access(candidate, os.W_OK) else None


class SharedLogits:
    """``rows x vocab`` float32 in a mapped file both processes see."""

    def __init__(self, path: str, rows: int, vocab: int) -> None:
        """Map the file at ``path`` (``rows * vocab * 4`` bytes)."""
        descriptor = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(descriptor, rows * vocab * 4)
        finally:
            os.close(descriptor)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32).view(rows, vocab)
        self.path = path

    @classmethod
    def create(cls, rows: int, vocab: int) -> SharedLogits:
        """A new zeroed file in shared memory, mapped; its name stays until ``unlink``."""
        descriptor, path = tempfile.mkstemp(prefix="dsv4-logits-", dir=shared_memory_dir())
        try:
            os.ftruncate(descriptor, rows * vocab * 4)
        finally:
            os.close(descriptor)
        try:
            return cls(path, rows, vocab)
        except BaseException:
            os.unlink(path)
            raise

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def write(self, logits: torch.Tensor) -> int:
        """Copy ``logits`` ``[n, vocab]`` into the first ``n`` rows; return ``n``."""
        rows = int(logits.shape[0])
        self.tensor[:rows].copy_(logits)
        return rows

    def read(self, rows: int) -> torch.Tensor:
        """A copy of the first ``rows`` rows."""
        return self.tensor[:rows].clone()
