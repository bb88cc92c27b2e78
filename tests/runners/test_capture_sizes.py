"""Capture sizes: validation, capture order and padding to the next captured size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runners import DEFAULT_CAPTURE_SIZES, CaptureSizeError
from runners.batch import CaptureSizes
from runners.cli.main import main
from runners.spec import EngineSpec, build_engine


def test_default_sizes_are_captured_largest_first() -> None:
    sizes = CaptureSizes.of(DEFAULT_CAPTURE_SIZES, max_num_tokens=64)
    assert DEFAULT_CAPTURE_SIZES == (1, 2, 4, 8, 16, 32)
    assert sizes.largest_first() == (32, 16, 8, 4, 2, 1)
    assert sizes.largest == 32


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_a_non_positive_or_non_integer_size_is_one_clear_error(bad: object) -> None:
    with pytest.raises(CaptureSizeError, match=f"capture size {bad!r} is not a positive integer"):
        CaptureSizes.of([1, bad], max_num_tokens=64)  # type: ignore[list-item]


def test_empty_or_over_budget_sizes_are_refused() -> None:
    with pytest.raises(CaptureSizeError, match="empty"):
        CaptureSizes.of([], max_num_tokens=64)
    with pytest.raises(CaptureSizeError, match="128 exceeds the runner's token budget 64"):
        CaptureSizes.of([1, 128], max_num_tokens=64)


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8),
    num_tokens=st.integers(1, 80),
)
def test_padding_picks_the_smallest_captured_size_that_fits(
    sizes: list[int], num_tokens: int
) -> None:
    capture = CaptureSizes.of(sizes, max_num_tokens=64)
    padded = capture.padded(num_tokens)
    fitting = [s for s in sizes if s >= num_tokens]
    assert padded == (min(fitting) if fitting else None)


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8),
    rows=st.integers(1, 80),
)
def test_the_sizes_serving_up_to_n_tokens_are_those_1_to_n_pad_to(
    sizes: list[int], rows: int
) -> None:
    capture = CaptureSizes.of(sizes, max_num_tokens=64)
    padded = {capture.padded(n) for n in range(1, rows + 1)} - {None}
    assert capture.serving(rows) == tuple(sorted(padded))


def test_a_size_no_step_can_carry_is_refused_before_anything_is_captured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One request of at most 32 tokens: no step ever carries 64, so no graph is kept for it."""
    small = {"max_num_seqs": 1, "max_model_len": 32, "block_size": 8}
    with pytest.raises(CaptureSizeError, match="capture size 64 exceeds what one step can carry"):
        build_engine(EngineSpec(platform="cpu", capture_sizes=(1, 64), **small))
    argv = ["run", "--platform", "cpu", "--prompt-ids", "1", "--capture-sizes", "1,64"]
    argv += ["--max-num-seqs", "1", "--max-model-len", "32", "--block-size", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "1 requests of at most 32 tokens hold 32" in err[0]
