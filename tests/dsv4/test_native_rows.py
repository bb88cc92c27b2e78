"""``gather_rows_into`` and ``scatter_rows_``: the row reads and writes of tables and caches as
native byte copies equal ``index_select`` and ``index_copy_`` bit for bit, in any dtype; an
index outside the table is refused (``IndexError``, as ATen's) and nothing is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.layers import read_rows
from dsv4.native_ops import GATHER_ROWS_INTO, SCATTER_ROWS_, rows_take
from dsv4.paging import write_rows
from graphs.op_count import OpCounter

pytestmark = pytest.mark.skipif(native.KERNELS is None, reason=native.reason)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool]


@given(
    dtype=st.sampled_from(DTYPES),
    table_rows=st.integers(1, 12),
    row_shape=st.lists(st.integers(1, 5), max_size=2),
    count=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_row_copies_equal_atens(
    dtype: torch.dtype, table_rows: int, row_shape: list[int], count: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    table = (torch.randn(table_rows, *row_shape, generator=generator) * 50).to(dtype)
    rows = torch.randint(0, table_rows, (count,), generator=generator)
    values = (torch.randn(count, *row_shape, generator=generator) * 50).to(dtype)
    written, expected = table.clone(), table.clone()
    for i in range(count):  # index_copy_ leaves a row written twice unspecified: in order here
        expected[rows[i]] = values[i]
    counter = OpCounter()
    with torch.inference_mode():
        assert rows_take(table, rows)
        with counter:
            got = read_rows(table, rows)
            write_rows(written, rows, values)
    assert counter.by_name["gather_rows_into"] == 1 and counter.by_name["scatter_rows_"] == 1
    assert torch.equal(got, table.index_select(0, rows))
    assert torch.equal(written, expected)


def test_an_index_outside_the_table_is_refused_and_nothing_is_written() -> None:
    table, out = torch.arange(6.0).view(3, 2), torch.full((2, 2), -1.0)
    with torch.inference_mode():
        with pytest.raises(IndexError, match="index out of range"):
            GATHER_ROWS_INTO(out, table, torch.tensor([0, 3]))
        with pytest.raises(IndexError, match="index out of range"):
            SCATTER_ROWS_(table, torch.tensor([-1, 1]), torch.zeros(2, 2))
    assert bool((out == -1.0).all())
    assert torch.equal(table, torch.arange(6.0).view(3, 2))
