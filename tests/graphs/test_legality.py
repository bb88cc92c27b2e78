"""Legality on the tape: each class of illegal op raises ``CaptureError`` naming the op and line.

Illegal inside a captured segment: host syncs, data-dependent output shapes, random ops and
tensor literals (a copy from pageable host memory). The same ops are fine in an eager break,
which re-runs them (with fresh host decisions) on replay.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from graphs import BreakableCapture, CaptureError, TapeBackend, eager_break_during_capture

Program = Callable[[torch.Tensor], object]

ILLEGAL: dict[str, tuple[Program, str]] = {
    "item": (lambda x: x.sum().item(), r"aten\.(item|_local_scalar_dense)"),
    "float": (lambda x: float(x[0, 0]), r"aten\.(item|_local_scalar_dense)"),
    "bool": (lambda x: bool(x.sum() > 0), r"aten\.is_nonzero"),
    "equal": (lambda x: torch.equal(x, x + 1), r"aten\.equal"),
    "nonzero": (lambda x: x.nonzero(), r"aten\.nonzero"),
    "where-one-arg": (lambda x: torch.where(x > 0), r"aten\.where"),
    "mask-read": (lambda x: x[x > 0], r"aten\.index\.Tensor"),
    "mask-write": (lambda x: x.__setitem__(x > 0, 0.0), r"aten\.index_put_"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), r"aten\.masked_select"),
    "unique": (lambda x: torch.unique(x), r"aten\._unique2"),
    "repeat_interleave": (
        lambda x: torch.repeat_interleave(x[0].long().abs()),
        r"aten\.repeat_interleave",
    ),
    "rand": (lambda x: torch.rand(3), r"aten\.rand"),
    "randn_like": (lambda x: torch.randn_like(x), r"aten\.randn_like"),
    "dropout-train": (lambda x: F.dropout(x, 0.5, training=True), r"aten\.dropout"),
    "bernoulli": (lambda x: torch.bernoulli(x.sigmoid()), r"aten\.bernoulli"),
    "multinomial": (lambda x: torch.multinomial(x.softmax(-1), 1), r"aten\.multinomial"),
    "tensor-literal": (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), r"aten\.lift_fresh"),
    "device-literal": (lambda x: x * torch.tensor([2.0], device=x.device), r"aten\.lift_fresh"),
    "index-literal": (lambda x: x[torch.tensor([2, 0])], r"aten\.lift_fresh"),
}

INDEX, REPEATS = torch.tensor([2, 0]), torch.tensor([1, 2])
"""Made outside every capture: a literal inside one is a host-to-device copy (illegal)."""

LEGAL: dict[str, Program] = {
    "integer-index": lambda x: x[INDEX],
    "dropout-eval": lambda x: F.dropout(x, 0.5, training=False),
    "repeat_interleave-sized": lambda x: torch.repeat_interleave(REPEATS, output_size=3),
    "one_hot-sized": lambda x: F.one_hot(INDEX, num_classes=4),
    "masked_fill": lambda x: x.masked_fill(x > 0, 0.0),
    "where-three-args": lambda x: torch.where(x > 0, x, 0.0),
}


@pytest.mark.parametrize("case", sorted(ILLEGAL))
def test_illegal_op_raises_naming_the_op_and_the_line(case: str) -> None:
    program, op = ILLEGAL[case]
    x = torch.randn(3, 4)
    line = program.__code__.co_firstlineno
    capture = BreakableCapture(TapeBackend())
    with (
        torch.inference_mode(),
        pytest.raises(CaptureError, match=rf"{op}.*test_legality\.py:{line}") as raised,
        capture,
    ):
        program(x * 1.0)
    assert "eager break" in str(raised.value)
    with pytest.raises(CaptureError, match="failed"):
        capture.replay()


@pytest.mark.parametrize("case", sorted(LEGAL))
def test_legal_lookalikes_capture_and_replay_like_eager(case: str) -> None:
    program = LEGAL[case]
    x = torch.randn(3, 4)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            out = program(x)
        x.copy_(torch.randn(3, 4))
        capture.replay()
        expected = program(x)
    assert isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", ["item", "bool", "nonzero", "mask-read", "unique"])
def test_illegal_ops_are_fine_in_an_eager_break_and_rerun_on_replay(case: str) -> None:
    program, _ = ILLEGAL[case]
    x = torch.zeros(3, 4)
    flag = torch.zeros(())

    @eager_break_during_capture
    def decide(y: torch.Tensor) -> None:
        program(y)  # whatever host work it does happens for real, every replay
        flag.fill_(1.0 if y.sum().item() > 0 else -1.0)

    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:
            y = x + 1.0
            decide(y)
            out = y * flag
        assert capture.layout == "GEG"
        for value in (-5.0, 2.0, -1.5):
            x.fill_(value)
            capture.replay()
            assert torch.equal(out, (x + 1.0) * (1.0 if value + 1.0 > 0 else -1.0))


def _helper_that_syncs(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]  # a data-dependent shape, issued inside a helper


def test_an_illegal_op_in_a_helper_names_the_helper_line_and_its_caller() -> None:
    helper_line = _helper_that_syncs.__code__.co_firstlineno + 1
    x = torch.randn(3)
    with (
        torch.inference_mode(),
        pytest.raises(CaptureError) as raised,
        BreakableCapture(TapeBackend()),
    ):
        _helper_that_syncs(x)  # the caller's line
    message = str(raised.value)
    assert f"test_legality.py:{helper_line} in _helper_that_syncs: return x[x > 0]" in message
    assert "(called from tests/graphs/test_legality.py:" in message
    assert "_helper_that_syncs(x)  # the caller's line)" in message
