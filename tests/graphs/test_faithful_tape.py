"""The tape is faithful to CUDA graphs by default: each semantic that can change a result or crash.

For each semantic there is a known-bad program the CPU catches, and a *mutation* test: the same
program with the semantic switched off inside the tape goes uncaught, so the catching test cannot
pass vacuously.
- Recording is not execution: produced tensors hold junk until a replay, outside writes are undone.
- Every eager break at capture runs on the values a replay gives (the capture protocol).
- An eager-break argument that could dangle on a GPU is an audit finding.
- A retired pool (all its graphs gone) is never recorded into again.
- A capture that raises leaves the backend usable; nothing keeps a dropped capture alive.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

from graphs import (
    AllocationTracker,
    BreakableCapture,
    CaptureAuditError,
    CaptureError,
    StaticMemory,
    TapeBackend,
    eager_break_during_capture,
)
from graphs.backend import PoolGraphs
from graphs.tape.stale import OutsideWrites, junk_value


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Objects die by reference count alone, as soon as the last reference goes."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _capture(program: Callable[[], object], backend: TapeBackend | None = None, **kw: object):  # type: ignore[no-untyped-def]
    capture = BreakableCapture(backend or TapeBackend(), **kw)  # type: ignore[arg-type]
    with torch.inference_mode(), capture:
        out = program()
    return capture, out


# -- recording is not execution: produced tensors hold junk until a replay ---------------------


def test_a_captured_output_is_junk_until_replay_and_right_after_it() -> None:
    x = torch.arange(6, dtype=torch.float32)
    capture, (floats, ints, flags) = _capture(lambda: (x * 2, (x * 3).long(), x > 2))
    assert torch.isnan(floats).all()
    assert ints.eq(torch.iinfo(torch.int64).max).all()
    assert flags.all()
    capture.replay()
    assert torch.equal(floats, x * 2)
    assert torch.equal(ints, (x * 3).long())
    assert torch.equal(flags, x > 2)


@pytest.mark.parametrize(
    ("dtype", "junk"),
    [
        (torch.float32, float("nan")),
        (torch.bfloat16, float("nan")),
        (torch.int32, 2**31 - 1),
        (torch.int64, 2**63 - 1),
        (torch.uint8, 255),
        (torch.bool, True),
    ],
)
def test_junk_is_nan_or_an_out_of_range_integer(dtype: torch.dtype, junk: object) -> None:
    value = junk_value(dtype)
    assert (value != value) if junk != junk else value == junk


def _reads_a_capture_output_before_replay() -> bool:
    """The known-bad program: use a captured index before the first replay. Returns whether
    the tape caught it (an index error, as the stale bytes of a GPU pool would give)."""
    table = torch.arange(10.0)
    positions = torch.tensor([1, 2, 3])
    _, index = _capture(lambda: positions + 1)
    try:
        table.index_select(0, index)
    except IndexError:
        return True
    return False


def test_reading_a_captured_index_before_replay_fails_loudly() -> None:
    assert _reads_a_capture_output_before_replay()


def test_without_junk_the_bad_read_goes_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("graphs.tape.backend.fill_junk", lambda storage, dtype: None)
    assert not _reads_a_capture_output_before_replay()


# -- recording is not execution: writes to outside memory are undone ---------------------------


def _counter_after_capture_and_seen_by_break() -> tuple[float, float]:
    """A segment increments an outside counter, an eager break reads it. Returns (what the
    break saw at capture, the counter after capture); CUDA gives (1, 1): the segment ran once,
    in the capture-time replay."""
    counter = torch.zeros(())
    seen: list[float] = []

    @eager_break_during_capture
    def read() -> None:
        seen.append(float(counter))

    def program() -> None:
        counter.add_(1)
        read()
        counter.mul_(1)  # a second graph segment, never replayed at capture

    _capture(program)
    return seen[0], float(counter)


def test_a_captured_write_to_outside_memory_happens_once_by_replay() -> None:
    assert _counter_after_capture_and_seen_by_break() == (1.0, 1.0)


def test_without_undoing_outside_writes_the_capture_applies_them_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(OutsideWrites, "restore", lambda self: None)
    assert _counter_after_capture_and_seen_by_break() == (2.0, 2.0)


def test_the_last_segments_outside_writes_wait_for_replay() -> None:
    buffer = torch.zeros(3)
    capture, _ = _capture(lambda: buffer.copy_(torch.ones(3)))
    assert buffer.eq(0).all()  # as on CUDA: recorded, not run
    capture.replay()
    assert buffer.eq(1).all()


# -- the capture protocol: an eager break at capture sees replayed values ----------------------


def _what_the_break_saw() -> torch.Tensor:
    x = torch.arange(4, dtype=torch.float32)
    seen: list[torch.Tensor] = []

    @eager_break_during_capture
    def observe(y: torch.Tensor) -> None:
        seen.append(y.clone())

    _capture(lambda: observe(x + 1))
    return seen[0]


def test_an_eager_break_at_capture_sees_the_replayed_values() -> None:
    assert torch.equal(_what_the_break_saw(), torch.arange(4, dtype=torch.float32) + 1)


def test_without_the_replay_before_the_break_it_sees_junk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BreakableCapture, "_replay_recorded", lambda self, segment: None)
    assert torch.isnan(_what_the_break_saw()).all()


def test_an_index_computed_by_a_graph_is_valid_in_the_eager_break_after_it() -> None:
    table, positions, out = torch.arange(10.0), torch.tensor([1, 2, 3]), torch.zeros(3)

    @eager_break_during_capture
    def gather(index: torch.Tensor) -> None:
        torch.index_select(table, 0, index, out=out)

    capture, _ = _capture(lambda: gather(positions * 2))
    assert torch.equal(out, torch.tensor([2.0, 4.0, 6.0]))
    positions.copy_(torch.tensor([0, 1, 4]))
    capture.replay()
    assert torch.equal(out, torch.tensor([0.0, 2.0, 8.0]))


# -- eager-break arguments that could dangle on a GPU ------------------------------------------


def _eager_argument_caught(audit: str = "raise") -> bool:
    """The known-bad program: an eager break called with a tensor allocated outside the
    capture, neither static nor kept by captured work. CUDA holds it by address: it dangles."""
    x = torch.ones(4)
    static = StaticMemory()
    static.register(x, "x")
    tracker = AllocationTracker()
    with tracker:
        scale = torch.full((4,), 2.0)  # allocated outside, never registered
    out = torch.zeros(4)
    static.register(out, "out")

    @eager_break_during_capture
    def scaled(y: torch.Tensor, factor: torch.Tensor) -> None:
        torch.mul(y, factor, out=out)

    try:
        _capture(lambda: scaled(x + 1, scale), static=static, audit=audit, allocations=tracker)
    except CaptureAuditError as error:
        message = str(error)
        assert "eager break" in message and "is called with a [4] float32 tensor" in message
        assert "scale = torch.full((4,), 2.0)" in message  # where it was allocated
        assert "dangle" in message
        return True
    return False


def test_an_eager_break_argument_that_could_dangle_is_an_audit_finding() -> None:
    assert _eager_argument_caught()


def test_without_the_argument_check_it_goes_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphs.audit import CaptureAudit

    monkeypatch.setattr(CaptureAudit, "check_eager_arguments", lambda self, fn, a, k: None)
    assert not _eager_argument_caught()


def test_eager_arguments_from_captured_work_static_memory_or_parameters_pass() -> None:
    layer = torch.nn.Linear(4, 4)
    x, out = torch.ones(1, 4), torch.zeros(1, 4)
    static = StaticMemory()
    static.register(x, "x")
    static.register(out, "out")

    @eager_break_during_capture
    def combine(y: torch.Tensor, inputs: tuple[torch.Tensor, ...], weight: torch.Tensor) -> None:
        torch.add(y, inputs[0] @ weight, out=out)

    capture, _ = _capture(lambda: combine(x * 2, (x,), layer.weight), static=static, audit="report")
    assert capture.audit_report.ok


# -- pools: a retired pool is never recorded into again ----------------------------------------


def _recapture_into_a_retired_pool() -> bool:
    """The known-bad program: drop every graph of a pool, then capture into it again (torch
    asserts ``use_count > 0`` on CUDA when a block still lives there). Returns whether it was
    refused."""
    backend = TapeBackend()
    x = torch.ones(3)
    capture, out = _capture(lambda: x + 1, backend)
    del capture, out
    assert backend.pool.graphs.retired
    try:
        _capture(lambda: x + 2, backend)
    except CaptureError as error:
        assert "retired" in str(error)
        return True
    return False


def test_a_pool_whose_graphs_are_gone_is_never_recorded_into_again(no_cyclic_gc: None) -> None:
    assert _recapture_into_a_retired_pool()


def test_without_retirement_the_reuse_goes_unseen(
    no_cyclic_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PoolGraphs, "require_recordable", lambda self: None)
    assert not _recapture_into_a_retired_pool()


def test_an_empty_segment_still_takes_a_use_of_its_pool(no_cyclic_gc: None) -> None:
    """CUDA's ``capture_begin`` takes a use of the pool even for a graph that records nothing,
    and the graph's destructor gives it back: the pool model counts one use per segment begun."""
    pool = PoolGraphs()
    use = pool.take()
    assert not pool.retired and pool.num_live == 1
    del use  # an empty graph dropped: the fresh pool's only use is given back
    assert pool.retired
    with pytest.raises(CaptureError, match="retired"):
        pool.require_recordable()


def test_a_capture_that_starts_with_an_eager_break_records_into_its_fresh_pool(
    no_cyclic_gc: None,
) -> None:
    """The first segment of a fresh pool is empty (the capture begins with a break): were its
    graph dropped, the pool would have no use left and the next segment's ``capture_begin``
    would assert on CUDA. The backend keeps it, so the capture and later ones record."""
    backend, x, mid = TapeBackend(), torch.ones(4), torch.zeros(4)

    @eager_break_during_capture
    def first(y: torch.Tensor) -> None:
        mid.copy_(y + 1)

    capture, out = _capture(lambda: (first(x), mid * 3)[1], backend)
    assert capture.layout == "EG"
    x.fill_(2.0)
    capture.replay()
    assert torch.equal(out, torch.full((4,), 9.0))
    again, out2 = _capture(lambda: (first(x), mid * 5)[1], backend)
    again.replay()
    assert torch.equal(out2, torch.full((4,), 15.0))


def test_a_pool_with_a_live_graph_takes_more_captures(no_cyclic_gc: None) -> None:
    backend, x = TapeBackend(), torch.ones(3)
    first, out = _capture(lambda: x + 1, backend)
    second, _second_out = _capture(lambda: x * 5, backend)
    del second
    third, out3 = _capture(lambda: x - 1, backend)
    for capture in (first, third):
        capture.replay()
    assert torch.equal(out, x + 1) and torch.equal(out3, x - 1)


def test_a_dropped_capture_is_freed_at_once_with_its_segments(no_cyclic_gc: None) -> None:
    static_out = torch.zeros(3)

    @eager_break_during_capture
    def step(y: torch.Tensor) -> None:
        static_out.copy_(y)

    x = torch.ones(3)
    static = StaticMemory()
    static.register(x, "x")
    static.register(static_out, "out")
    capture, _ = _capture(lambda: step(x + 1), static=static, audit="raise")
    segments = [weakref.ref(s) for s in capture.segments]
    alive = weakref.ref(capture)
    del capture
    assert alive() is None
    assert all(ref() is None for ref in segments)


# -- failures leave the backend usable ---------------------------------------------------------


def test_a_capture_that_raises_leaves_the_backend_usable(no_cyclic_gc: None) -> None:
    backend, x = TapeBackend(), torch.ones(3)
    keep, kept_out = _capture(lambda: x * 3, backend)  # keeps the pool alive

    @eager_break_during_capture
    def fails(y: torch.Tensor) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _capture(lambda: fails(x + 1), backend)
    capture, out = _capture(lambda: x + 4, backend)
    capture.replay()
    keep.replay()
    assert torch.equal(out, x + 4) and torch.equal(kept_out, x * 3)


def test_a_failed_begin_leaves_the_tape_not_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphs.tape.recording import Recorder

    backend = TapeBackend()
    with monkeypatch.context() as patch:
        patch.setattr(Recorder, "__enter__", lambda self: (_ for _ in ()).throw(OSError("no")))
        with pytest.raises(OSError, match="no"):
            backend.begin_segment()
    capture, out = _capture(lambda: torch.ones(2) + 1, backend)
    capture.replay()
    assert torch.equal(out, torch.full((2,), 2.0))
