"""``runners.shared_logits``: two mappings of one file see each other's writes, reads are
copies, and the file's name can go while the mappings stay valid."""

from __future__ import annotations

import os
import tempfile

import torch

from runners.shared_logits import SharedLogits, shared_memory_dir


def test_rows_written_through_one_mapping_are_read_through_another() -> None:
    rank0 = SharedLogits.create(4, 10)
    driver = SharedLogits(rank0.path, 4, 10)
    rank0.unlink()
    assert not os.path.exists(rank0.path)  # the name is gone; both mappings stay valid
    logits = torch.arange(30, dtype=torch.float32).view(3, 10)
    assert rank0.write(logits) == 3
    read = driver.read(3)
    assert torch.equal(read, logits)
    rank0.write(torch.zeros(3, 10))  # the next step overwrites the rows ...
    assert torch.equal(read, logits)  # ... but not what was read
    assert torch.equal(driver.read(1), torch.zeros(1, 10))


def test_the_file_is_created_in_shared_memory_where_there_is_one() -> None:
    logits = SharedLogits.create(1, 1)
    logits.unlink()
    expected = shared_memory_dir() or tempfile.gettempdir()
    assert os.path.dirname(logits.path) == expected
    assert os.path.basename(logits.path).startswith("dsv4-logits-")
