"""``plan_offsets`` against a hand-written all-pairs greedy placement, and its invariants.

The planner prunes which placed blocks it compares against; these tests check that the pruning
never changes the placement the plain all-pairs greedy gives, and that blocks whose lifetimes
intersect never share a byte.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from graphs.tape.memory import ALIGNMENT, Lifetime, plan_offsets


def _reference(blocks: list[Lifetime]) -> tuple[dict[int, int], int]:
    """Largest first, each at the lowest aligned offset clear of every intersecting block."""
    placed: list[tuple[int, int, Lifetime]] = []
    offsets: dict[int, int] = {}
    for block in sorted(blocks, key=lambda b: (-b.nbytes, b.first, b.key)):
        size = -(-block.nbytes // ALIGNMENT) * ALIGNMENT
        offset = 0
        moved = True
        while moved:
            moved = False
            for start, width, other in placed:
                live = other.first <= block.last and block.first <= other.last
                if live and start < offset + size and offset < start + width:
                    offset, moved = start + width, True
        placed.append((offset, size, block))
        offsets[block.key] = offset
    return offsets, max((o + w for o, w, _ in placed), default=0)


@st.composite
def _blocks(draw: st.DrawFn) -> list[Lifetime]:
    span = draw(st.sampled_from([4, 80, 400]))
    blocks = []
    for key in range(draw(st.integers(0, 40))):
        first = draw(st.integers(0, span))
        length = draw(st.one_of(st.integers(0, 3), st.integers(60, 70), st.integers(0, span)))
        nbytes = draw(st.one_of(st.sampled_from([1, 64, 65, 4096]), st.integers(1, 10**5)))
        blocks.append(Lifetime(key=key, nbytes=nbytes, first=first, last=first + length))
    return blocks


@given(_blocks())
def test_plan_offsets_matches_all_pairs_greedy(blocks: list[Lifetime]) -> None:
    assert plan_offsets(blocks) == _reference(blocks)


@given(_blocks())
def test_intersecting_lifetimes_never_share_bytes(blocks: list[Lifetime]) -> None:
    offsets, total = plan_offsets(blocks)
    for a in blocks:
        assert offsets[a.key] % ALIGNMENT == 0
        assert offsets[a.key] + a.nbytes <= total
        for b in blocks:
            if a.key < b.key and a.first <= b.last and b.first <= a.last:
                a_end, b_end = offsets[a.key] + a.nbytes, offsets[b.key] + b.nbytes
                assert a_end <= offsets[b.key] or b_end <= offsets[a.key]
