"""The capture audit and static memory: what counts as stable, what is reported, and how."""

from __future__ import annotations

import inspect

import pytest
import torch

from graphs import (
    AllocationTracker,
    BreakableCapture,
    CaptureAuditError,
    StaticMemory,
    TapeBackend,
    eager_break_during_capture,
)


class Block(torch.nn.Module):
    """A linear layer plus a buffer: parameters are stable, the buffer needs registration."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("bias2", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.bias2


def _capture(program: object, **kwargs: object) -> BreakableCapture:
    capture = BreakableCapture(TapeBackend(), **kwargs)  # type: ignore[arg-type]
    with torch.inference_mode(), capture:
        program()  # type: ignore[operator]
    return capture


def test_registered_inputs_parameters_and_registered_buffers_pass() -> None:
    block, x = Block(), torch.randn(2, 4)
    static = StaticMemory()
    static.register(x, "x")
    static.register_module(block, "block")
    capture = _capture(lambda: block(x[1:]), static=static, audit="raise")  # a view of x
    assert capture.audit_report.ok
    assert static.name_of(block.bias2) == "block.bias2"
    assert static.name_of(x[1:]) == "x"


def test_an_unregistered_buffer_is_reported_with_op_shape_and_line() -> None:
    block, x = Block(), torch.randn(2, 4)
    static = StaticMemory()
    static.register(x, "x")
    capture = _capture(lambda: block(x), static=static, audit="report")
    (finding,) = capture.audit_report
    assert finding.op == "aten.add.Tensor" and finding.access == "reads"
    assert finding.shape == (4,) and finding.dtype == "float32"
    assert "outside the capture" in finding.allocated_at
    assert "return self.proj(x) + self.bias2" in finding.location
    assert "aten.add.Tensor reads a [4] float32 tensor" in str(capture.audit_report)


def test_raise_mode_stops_the_capture_at_the_first_unstable_read() -> None:
    x, fresh = torch.randn(4), torch.randn(4)
    static = StaticMemory()
    static.register(x, "x")
    with pytest.raises(CaptureAuditError, match=r"aten\.mul\.Tensor reads a \[4\] float32"):
        _capture(lambda: x * fresh, static=static)  # static memory given: audit defaults to raise


def test_writes_into_unstable_memory_are_reported() -> None:
    x, out = torch.randn(4), torch.empty(4)
    static = StaticMemory()
    static.register(x, "x")
    capture = _capture(lambda: out.copy_(x * 2), static=static, audit="report")
    (finding,) = capture.audit_report
    assert finding.op == "aten.copy_.default" and finding.access == "writes"


def _make_index() -> torch.Tensor:
    return torch.arange(3) * 2


_INDEX_LINE = inspect.getsourcelines(_make_index)[1] + 1


def test_the_allocation_site_comes_from_an_allocation_tracker() -> None:
    tracker = AllocationTracker()
    with tracker:
        index = _make_index()
    cache, x = torch.zeros(8, 4), torch.randn(3, 4)
    static = StaticMemory()
    static.register_many((cache, x), "buffer")
    capture = _capture(
        lambda: cache.index_copy_(0, index, x),
        static=static,
        audit="report",
        allocations=tracker,
    )
    (finding,) = capture.audit_report
    assert finding.op == "aten.index_copy_.default" and finding.shape == (3,)
    assert f"test_audit.py:{_INDEX_LINE} in _make_index" in finding.allocated_at
    assert tracker.site_of(index) is not None and tracker.site_of(x) is None


def test_a_tensor_an_eager_segment_allocates_is_unstable_for_later_graphs() -> None:
    """Replay re-runs the eager segment, which allocates anew; the graph keeps the old one."""
    x = torch.randn(4)
    buffer = torch.zeros(4)
    static = StaticMemory()
    static.register(x, "x")

    @eager_break_during_capture
    def returns_new(y: torch.Tensor) -> torch.Tensor:
        return y + 1

    @eager_break_during_capture
    def writes_into(y: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(y + 1)

    def program() -> None:
        y = x * 2
        returns_new(y) * 3  # unstable: the eager result is fresh on every replay
        out = torch.empty_like(y)  # allocated by the graph: stable
        writes_into(y, out)
        buffer.copy_(out * 3)

    static.register(buffer, "buffer")
    capture = _capture(program, static=static, audit="report")
    (finding,) = capture.audit_report
    assert finding.op == "aten.mul.Tensor"
    assert "inside an eager segment" in finding.allocated_at
    assert "returns_new" in finding.allocated_at
    x.fill_(1.0)
    capture.replay()
    assert torch.equal(buffer, torch.full((4,), 9.0))


def test_audit_off_and_its_default() -> None:
    x = torch.randn(4)
    fresh = torch.randn(4)
    assert _capture(lambda: x * fresh).audit_report.mode == "off"  # no static memory: off
    report = _capture(lambda: x * fresh, audit="off").audit_report
    assert report.ok and str(report) == "capture audit: off"


def test_bad_input_is_one_clear_error_each() -> None:
    static = StaticMemory()
    with pytest.raises(TypeError, match=r"static memory must be a torch\.Tensor, got list"):
        static.register([1, 2], "numbers")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use register_module for a module"):
        static.register(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module, got Tensor"):
        static.register_module(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown audit mode 'loud'"):
        BreakableCapture(TapeBackend(), audit="loud")  # type: ignore[arg-type]
    assert len(static) == 0
