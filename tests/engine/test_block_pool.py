"""BlockPool against a set model: ids never handed out twice, LIFO reuse, loud misuse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runners.engine import BlockPool


@given(st.integers(1, 20), st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_pool_matches_a_set_model(size: int, ops: list[tuple[bool, int]]) -> None:
    pool = BlockPool(size)
    held: list[list[int]] = []
    for allocate, n in ops:
        if allocate and n <= pool.num_free:
            ids = pool.allocate(n)
            assert len(ids) == n
            assert not {i for group in held for i in group} & set(ids)
            assert all(0 <= i < size for i in ids)
            held.append(ids)
        elif held:
            group = held.pop(n % len(held))
            pool.free(group)
            if group:
                assert pool.allocate(len(group)) == group
                pool.free(group)
        assert pool.num_free == size - sum(len(g) for g in held)


def test_fresh_pool_hands_out_lowest_ids_and_misuse_raises() -> None:
    pool = BlockPool(4, what="KV block")
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks with 1 free"):
        pool.allocate(2)
    pool.free([1])
    with pytest.raises(RuntimeError, match="KV block 1 freed twice"):
        pool.free([1])
    with pytest.raises(ValueError, match="at least one"):
        BlockPool(0)
