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


class _Model:
    """The pool restated: references, keys, the free list (last in, first out) and the idle
    list (least recently used first)."""

    def __init__(self, size: int) -> None:
        self.refs = [0] * size
        self.keys: dict[int, int] = {}
        self.free = list(range(size - 1, -1, -1))
        self.idle: list[int] = []

    def allocate(self, count: int) -> list[int]:
        taken = [self.free.pop() for _ in range(min(count, len(self.free)))]
        while len(taken) < count:
            block = self.idle.pop(0)
            del self.keys[block]
            taken.append(block)
        for block in taken:
            self.refs[block] = 1
        return taken

    def release(self, ids: list[int]) -> None:
        for block in ids:
            self.refs[block] -= 1
        unheld = [b for b in ids if self.refs[b] == 0]
        self.idle += [b for b in reversed(unheld) if b in self.keys]
        self.free += [b for b in reversed(unheld) if b not in self.keys]


@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.sampled_from(["allocate", "free", "key", "share"]), st.integers(0, 20))),
)
def test_cached_pool_matches_a_model(size: int, ops: list[tuple[str, int]]) -> None:
    """References, keys and eviction against ``_Model``: a keyed block nobody holds stays
    findable and counts as free, and is evicted least recently used first, only once every
    unkeyed free block is taken."""
    pool, model = BlockPool(size), _Model(size)
    groups: list[list[int]] = []
    next_key = 0
    for op, n in ops:
        held = [b for b in range(size) if model.refs[b] > 0]
        if op == "allocate" and 1 <= n % 4 <= pool.num_free:
            taken = pool.allocate(n % 4)
            assert taken == model.allocate(n % 4)
            groups.append(taken)
        elif op == "free" and groups:
            group = groups.pop(n % len(groups))
            pool.free(group)
            model.release(group)
        elif op == "key" and held:
            block = held[n % len(held)]
            key = next_key if n % 2 or not model.keys else sorted(model.keys.values())[0]
            other = next((b for b, k in model.keys.items() if k == key), None)
            took = pool.set_key(block, key)
            assert took == (block not in model.keys and (other is None or model.refs[other] == 0))
            if took:
                if other is not None:  # an idle copy gives its key up and is free
                    del model.keys[other]
                    model.idle.remove(other)
                    model.free.append(other)
                model.keys[block] = key
            next_key += 1
        elif op == "share" and model.keys:
            block = sorted(model.keys)[n % len(model.keys)]
            assert pool.is_idle(block) == (block in model.idle)
            pool.share([block])
            if block in model.idle:
                model.idle.remove(block)
            model.refs[block] += 1
            groups.append([block])
        assert pool.num_free == len(model.free) + len(model.idle)
        assert pool.free_ids() == tuple(model.free)
        assert [pool.refs(b) for b in range(size)] == model.refs
        for block, key in model.keys.items():
            assert pool.find(key) == block
        assert pool.num_cached == len(model.keys)


def test_a_cached_block_is_findable_until_evicted_and_misuse_raises() -> None:
    pool = BlockPool(3, what="KV block")
    a, b = pool.allocate(2)
    assert pool.set_key(a, "A") and not pool.set_key(b, "A") and not pool.set_key(a, "B")
    pool.free([a, b])
    assert (pool.num_free, pool.find("A"), pool.is_idle(a)) == (3, a, True)
    assert pool.allocate(2) == [b, 2]  # the free ones first; the cached one stays
    assert pool.allocate(1) == [a] and pool.find("A") is None and pool.num_evicted == 1
    pool.free([b])
    with pytest.raises(RuntimeError, match="KV block 1 is not held"):
        pool.set_key(b, "B")
    with pytest.raises(RuntimeError, match="KV block 1 is free: nothing to share"):
        pool.share([b])


def test_a_block_computed_again_takes_the_key_of_its_idle_copy() -> None:
    pool = BlockPool(3)
    old, held = pool.allocate(2)
    assert pool.set_key(old, "A") and not pool.set_key(held, "A")  # both held: the first keeps it
    pool.free([old])
    assert pool.set_key(held, "A") and pool.find("A") == held  # the idle copy gives it up
    assert pool.free_ids()[-1] == old and not pool.is_idle(old)  # and is handed out next
    assert pool.allocate(1) == [old]
