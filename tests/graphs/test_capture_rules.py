"""One test per rule of DESIGN §4, run on the CPU tape backend.

Each test checks values after replay against a hand-derived expectation, not only counts.
"""

from __future__ import annotations

import threading

import pytest
import torch

from graphs import (
    BreakableCapture,
    CaptureError,
    ForwardContext,
    eager_break_during_capture,
    forward_context,
    get_forward_context,
)


class Program:
    """x -> y = 2x (graph) -> z = y + 1 (eager, into a preallocated buffer) -> w = 3z (graph)."""

    def __init__(self) -> None:
        self.x = torch.zeros(4)
        self.z = torch.zeros(4)
        self.eager_calls = 0
        self.inner_calls = 0

    @eager_break_during_capture
    def inner(self, y: torch.Tensor) -> None:
        self.inner_calls += 1
        self.z.copy_(y + 1)

    @eager_break_during_capture
    def outer(self, y: torch.Tensor) -> None:
        self.eager_calls += 1
        self.inner(y)

    def forward(self, nested: bool) -> torch.Tensor:
        y = self.x * 2
        if nested:
            self.outer(y)
        else:
            self.eager_calls += 1
            self.inner(y)
        return self.z * 3


def _no_capture_active() -> bool:
    """No capture is active in this thread exactly when a new one can be entered here."""
    try:
        with BreakableCapture(device="cpu"):
            pass
    except CaptureError:
        return False
    return True


def _replay_with(program: Program, capture: BreakableCapture, values: list[float]) -> None:
    program.x.copy_(torch.tensor(values))
    capture.replay()


def test_layout_is_graph_eager_graph() -> None:
    program = Program()
    with BreakableCapture(device="cpu") as capture:
        out = program.forward(nested=False)
    assert capture.layout == "GEG"
    assert (capture.num_graphs, capture.num_eager_breaks) == (2, 1)
    _replay_with(program, capture, [1.0, 2.0, 3.0, 4.0])
    assert torch.equal(out, (torch.tensor([1.0, 2.0, 3.0, 4.0]) * 2 + 1) * 3)


def test_break_nested_in_an_eager_region_runs_inline_on_every_replay() -> None:
    program = Program()
    with BreakableCapture(device="cpu") as capture:
        out = program.forward(nested=True)
    assert capture.layout == "GEG"
    assert (program.eager_calls, program.inner_calls) == (1, 1)
    for step in range(3):
        _replay_with(program, capture, [float(step)] * 4)
        assert torch.equal(out, torch.full((4,), (2.0 * step + 1) * 3))
    assert (program.eager_calls, program.inner_calls) == (4, 4)


def test_break_under_full_capture_runs_inline_and_is_captured() -> None:
    program = Program()
    with BreakableCapture(device="cpu", full=True) as capture:
        out = program.forward(nested=True)
    assert capture.layout == "G"
    _replay_with(program, capture, [5.0, 6.0, 7.0, 8.0])
    assert torch.equal(out, (torch.tensor([5.0, 6.0, 7.0, 8.0]) * 2 + 1) * 3)
    assert program.inner_calls == 1, "under FULL the break's Python does not run on replay"


def test_capture_is_thread_local() -> None:
    program = Program()
    seen: dict[str, object] = {}

    def other_thread() -> None:
        seen["none active"] = _no_capture_active()
        other = Program()
        other.x.fill_(1.0)
        other.inner(other.x * 2)  # a plain call: no capture in this thread
        seen["z"] = other.z.clone()
        with BreakableCapture(device="cpu") as own:
            other.forward(nested=False)
        seen["layout"] = own.layout

    with BreakableCapture(device="cpu") as capture:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        program.forward(nested=False)
    assert seen["none active"]
    assert torch.equal(seen["z"], torch.full((4,), 3.0))  # type: ignore[arg-type]
    assert seen["layout"] == "GEG"
    assert capture.layout == "GEG"


def test_nested_capture_is_an_error_and_leaves_the_outer_intact() -> None:
    program = Program()
    with BreakableCapture(device="cpu") as capture:
        with pytest.raises(CaptureError, match="already active"), BreakableCapture(device="cpu"):
            pass
        out = program.forward(nested=False)
    _replay_with(program, capture, [1.0] * 4)
    assert torch.equal(out, torch.full((4,), 9.0))


def test_exception_clears_the_capture_and_it_cannot_be_replayed() -> None:
    program = Program()
    capture = BreakableCapture(device="cpu")
    with pytest.raises(ValueError, match="boom"), capture:
        program.forward(nested=False)
        raise ValueError("boom")
    assert _no_capture_active()
    with pytest.raises(CaptureError, match="failed"):
        capture.replay()
    with BreakableCapture(device="cpu") as again:
        out = program.forward(nested=False)
    _replay_with(program, again, [2.0] * 4)
    assert torch.equal(out, torch.full((4,), 15.0))


def test_exception_inside_an_eager_break_clears_the_capture() -> None:
    @eager_break_during_capture
    def failing(t: torch.Tensor) -> None:
        raise RuntimeError("eager failure")

    capture = BreakableCapture(device="cpu")
    with pytest.raises(RuntimeError, match="eager failure"), capture:
        failing(torch.ones(2) * 2)
    assert _no_capture_active()
    with pytest.raises(CaptureError):
        capture.replay()


def test_counts_follow_the_breaks() -> None:
    buf = torch.zeros(3)

    @eager_break_during_capture
    def bump(t: torch.Tensor) -> None:
        buf.add_(t)

    x = torch.ones(3)
    with BreakableCapture(device="cpu") as capture:
        for _ in range(3):
            bump(x * 1)
        y = buf * 2
    assert capture.layout == "GEGEGEG"
    assert (capture.num_graphs, capture.num_eager_breaks) == (4, 3)
    capture.replay()
    assert torch.equal(buf, torch.full((3,), 6.0))
    assert torch.equal(y, torch.full((3,), 12.0))


def test_back_to_back_breaks_drop_the_empty_graph_between_them() -> None:
    log: list[str] = []

    @eager_break_during_capture
    def first() -> None:
        log.append("first")

    @eager_break_during_capture
    def second() -> None:
        log.append("second")

    x = torch.ones(2)
    with BreakableCapture(device="cpu") as capture:
        _ = x + 1
        first()
        second()
        _ = x + 2
    assert capture.layout == "GEEG"
    capture.replay()
    assert log == ["first", "second", "first", "second"]


def test_replay_runs_segments_in_capture_order() -> None:
    log: list[str] = []
    x = torch.zeros(2)
    a = torch.zeros(2)
    b = torch.zeros(2)

    @eager_break_during_capture
    def stage(name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        log.append(name)
        dst.copy_(src + 10)

    with BreakableCapture(device="cpu") as capture:
        stage("A", x * 2, a)
        stage("B", a * 3, b)
        out = b - 1
    log.clear()
    x.copy_(torch.tensor([1.0, 2.0]))
    capture.replay()
    assert log == ["A", "B"]
    assert torch.equal(out, ((torch.tensor([1.0, 2.0]) * 2 + 10) * 3 + 10) - 1)


def test_eager_segments_read_the_forward_context_at_replay_time() -> None:
    out = torch.zeros(1)

    @eager_break_during_capture
    def read_metadata() -> None:
        out.fill_(float(get_forward_context().attn_metadata))

    with forward_context(ForwardContext(attn_metadata=1)), BreakableCapture() as capture:
        read_metadata()
    with forward_context(ForwardContext(attn_metadata=7)):
        capture.replay()
    assert out.item() == 7.0


def test_replay_of_an_empty_capture_is_an_error() -> None:
    with BreakableCapture(device="cpu") as capture:
        pass
    with pytest.raises(CaptureError, match="empty"):
        capture.replay()


def test_replay_before_capture_is_an_error() -> None:
    with pytest.raises(CaptureError, match="not yet captured"):
        BreakableCapture(device="cpu").replay()
