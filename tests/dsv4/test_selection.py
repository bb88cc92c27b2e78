"""``stable_topk``, the model's one top-k: the lower index wins among equal scores.

Every check runs all of its ways: the stable sort (up to ``SORT_ELEMENTS`` scores), the int64
key (above: the same rows, repeated until there are more) and, where autograd does not record
and the kernels were built, the native single pass (``k`` up to ``NATIVE_K``):
- It equals a hand-written reference (Python's sort by score, then index) and vLLM's canonical
  selection (every score above the k-th, then the lowest indices tied at it) on rows drawn from
  a few values, so most rows tie at the cut; ``-0.0`` ties with ``0.0``.
- Appending lower candidates (``-inf`` padding, as a wider context bucket adds) changes neither
  the choice nor its order, whatever the width; ``torch.topk`` shown not to hold that.
- Captured on the tape it replays equal to eager on new scores (static shapes, no host sync).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4 import native
from dsv4.selection import NATIVE_K, SORT_ELEMENTS, stable_topk
from graphs import BreakableCapture, TapeBackend
from graphs.op_count import OpCounter

INF = float("inf")
VALUES = [0.0, -0.0, 1.5, -2.0, 0.25, 3e38, -INF, INF, 1e-45]
"""Few distinct values (two zeros, a denormal, infinities): ties at the cut in most rows."""


def reference(row: list[float], k: int) -> list[int]:
    """The rule by hand: sort indices by score, descending, then by index, ascending."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def canonical_set(row: list[float], k: int) -> set[int]:
    """vLLM's canonical selection: every score above the k-th, plus the lowest-index entries
    tied at the k-th."""
    threshold = sorted(row, reverse=True)[k - 1]
    above = {i for i, v in enumerate(row) if v > threshold}
    tied = [i for i, v in enumerate(row) if v == threshold]
    return above | set(tied[: k - len(above)])


def both_ways(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``stable_topk`` by the sort, by the key and natively, which must agree; the choice."""
    repeats = SORT_ELEMENTS // scores.numel() + 1
    by_sort = stable_topk(scores, k)  # autograd records here: no native op
    by_key = stable_topk(scores.repeat(repeats, 1), k)
    assert scores.numel() <= SORT_ELEMENTS < scores.numel() * repeats
    assert torch.equal(by_key, by_sort.repeat(repeats, 1))
    if native.KERNELS is not None and k <= NATIVE_K and scores.dtype == torch.float32:
        counter = OpCounter()
        with torch.inference_mode(), counter:
            by_native = stable_topk(scores, k)
        assert counter.by_name["stable_topk_into"] == 1
        assert "sort" not in counter.by_name
        assert torch.equal(by_native, by_sort)
    return by_sort


rows = st.lists(
    st.lists(st.sampled_from(VALUES) | st.floats(-4, 4, width=32), min_size=1, max_size=40),
    min_size=1,
    max_size=4,
).filter(lambda rs: len({len(r) for r in rs}) == 1)


@given(rows=rows, data=st.data())
def test_the_lower_index_wins_among_equal_scores(
    rows: list[list[float]], data: st.DataObject
) -> None:
    k = data.draw(st.integers(1, len(rows[0])))
    chosen = both_ways(torch.tensor(rows, dtype=torch.float32), k).tolist()
    for row, picked in zip(rows, chosen, strict=True):
        assert picked == reference(row, k)
        assert set(picked) == canonical_set(row, k)


@given(rows=rows, data=st.data())
def test_padding_below_every_score_changes_nothing(
    rows: list[list[float]], data: st.DataObject
) -> None:
    """A row padded with ``-inf`` up to any width chooses the same real candidates in the same
    order, padding only after them (a padded candidate never beats a real one)."""
    scores = torch.tensor(rows, dtype=torch.float32).clamp(min=-3e38)  # real scores are finite
    width = scores.shape[1]
    k = data.draw(st.integers(1, width))
    pad = data.draw(st.integers(1, 600))
    padded = torch.cat((scores, torch.full((scores.shape[0], pad), -INF)), dim=1)
    assert torch.equal(stable_topk(padded, k), both_ways(scores, k))
    wider = stable_topk(padded, width + min(pad, 3))
    assert torch.equal(wider[:, :width], both_ways(scores, width))
    assert bool((wider[:, width:] >= width).all())


def test_torch_topk_breaks_ties_by_width_and_stable_topk_does_not() -> None:
    """The measurement REFERENCE §B reports, and the rule's answer for every width."""
    answers = set()
    for width in (10, 32, 64, 600, 2000, 3000):
        row = torch.full((1, width), -INF)
        row[0, :20] = 0.0
        row[0, 5] = 1.0
        answers.add(tuple(torch.topk(row, 4).indices[0].tolist()))
        assert stable_topk(row, 4)[0].tolist() == [5, 0, 1, 2]
    assert len(answers) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrower_scores_are_ranked_exactly(dtype: torch.dtype) -> None:
    scores = torch.tensor([[0.5, -0.0, 0.5, 0.0, -1.0, 0.5]], dtype=dtype)
    assert both_ways(scores, 5).tolist() == [[0, 2, 5, 1, 3]]


def test_wider_scores_are_refused() -> None:
    with pytest.raises(TypeError, match=r"float32, bfloat16 or float16 scores, not torch\.float64"):
        stable_topk(torch.zeros(2, 3, dtype=torch.float64), 1)


@pytest.mark.parametrize("rows", [3, 50], ids=["sort", "key"])
def test_captured_on_the_tape_it_replays_like_eager(rows: int) -> None:
    generator = torch.Generator().manual_seed(0)

    def draw() -> torch.Tensor:
        values = torch.tensor(VALUES[:6])
        return values[torch.randint(0, len(values), (rows, 50), generator=generator)]

    scores = draw()
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = stable_topk(scores, 7)
        for _ in range(3):
            scores.copy_(draw())
            capture.replay()
            assert torch.equal(out, stable_topk(scores.clone(), 7))
