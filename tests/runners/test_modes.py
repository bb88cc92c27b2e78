"""Graph modes: the decode/mixed split, each basic mode's region requirement, name lookup."""

from __future__ import annotations

import pytest

from graphs import FullGraph, NarrowRegion, NoGraph
from runners import CUDAGraphMode, UnknownModeError

M = CUDAGraphMode


@pytest.mark.parametrize(
    ("mode", "decode", "mixed"),
    [
        (M.NONE, M.NONE, M.NONE),
        (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE),
        (M.FULL, M.FULL, M.FULL),
        (M.FULL_DECODE_ONLY, M.FULL, M.NONE),
        (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE),
    ],
)
def test_split_by_batch_kind(mode: M, decode: M, mixed: M) -> None:
    assert (mode.decode_mode(), mode.mixed_mode()) == (decode, mixed)
    assert mode.mode_for(uniform_decode=True) is decode
    assert mode.mode_for(uniform_decode=False) is mixed
    assert decode.is_basic and mixed.is_basic


def test_each_basic_mode_requires_its_own_region() -> None:
    assert M.NONE.required_strategy == NoGraph()
    assert M.PIECEWISE.required_strategy == NarrowRegion()
    assert M.FULL.required_strategy == FullGraph()
    with pytest.raises(ValueError, match="not a basic mode"):
        _ = M.FULL_AND_PIECEWISE.required_strategy


def test_names_are_case_insensitive_and_unknown_names_list_the_valid_ones() -> None:
    assert M.from_name("full_and_piecewise") is M.FULL_AND_PIECEWISE
    assert M.from_name(" NONE ") is M.NONE
    with pytest.raises(UnknownModeError, match=r"'PIECE'.*NONE, PIECEWISE, FULL"):
        M.from_name("PIECE")
