"""``CudaGraphBackend``: a clear error without a GPU; the capture rules on a real GPU.

The GPU tests are behind the ``cuda`` marker and skip cleanly where no GPU is available.
"""

from __future__ import annotations

import pytest
import torch

from graphs import BackendUnavailableError, BreakableCapture, eager_break_during_capture
from graphs.allocations import AllocationSites
from graphs.capture import backend_for_device
from graphs.cuda_backend import CudaGraphBackend, _SegmentWatch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_unavailable_without_a_gpu_is_one_clear_error() -> None:
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        CudaGraphBackend()
    with pytest.raises(BackendUnavailableError):
        backend_for_device("cuda")


@pytest.mark.cuda
def test_graph_eager_graph_replays_new_inputs_on_the_gpu() -> None:
    device = torch.device("cuda")
    x = torch.zeros(8, device=device)
    mid = torch.zeros(8, device=device)
    calls = []

    @eager_break_during_capture
    def eager_step(y: torch.Tensor) -> None:
        calls.append(1)
        mid.copy_(y + 1)

    def program() -> torch.Tensor:
        eager_step(x * 2)
        return mid * 3

    program()  # warm up kernels outside the capture
    torch.cuda.synchronize()
    backend = CudaGraphBackend(device=device)
    with BreakableCapture(backend) as capture:
        out = program()
    assert capture.layout == "GEG"
    for step in range(3):
        x.copy_(torch.arange(8, device=device, dtype=torch.float32) + step)
        capture.replay()
        torch.cuda.synchronize()
        expected = ((torch.arange(8, dtype=torch.float32) + step) * 2 + 1) * 3
        assert torch.equal(out.cpu(), expected)


@pytest.mark.cuda
def test_full_capture_inlines_breaks_on_the_gpu() -> None:
    device = torch.device("cuda")
    x = torch.zeros(8, device=device)
    mid = torch.zeros(8, device=device)

    @eager_break_during_capture
    def eager_step(y: torch.Tensor) -> None:
        mid.copy_(y + 1)

    def program() -> torch.Tensor:
        eager_step(x * 2)
        return mid * 3

    program()
    torch.cuda.synchronize()
    with BreakableCapture(CudaGraphBackend(device=device), full=True) as capture:
        out = program()
    assert capture.layout == "G"
    x.fill_(4.0)
    capture.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.full((8,), 27.0))


@pytest.mark.cuda
def test_captures_of_one_backend_share_its_pool_memory() -> None:
    """Captured largest first into one backend, a smaller capture reuses the block a larger
    one freed: device memory does not grow (with a pool per capture it would, by 32 MiB)."""
    backend = CudaGraphBackend(device="cuda")
    x = torch.ones(1 << 24, device="cuda")  # 64 MiB

    def program(n: int) -> torch.Tensor:
        return (x[:n] * 2).sum()  # a temporary of n floats, freed inside the capture

    backend.warm_up(lambda: program(1 << 24))
    with BreakableCapture(backend) as large:
        program(1 << 24)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with BreakableCapture(backend) as small:
        program(1 << 23)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    assert large.num_graphs == small.num_graphs == 1


def test_eager_arguments_are_held_member_by_member() -> None:
    """hold reaches tensors inside tuples, named tuples, lists, dicts and attrs values."""
    import collections

    import attrs

    from graphs._tensor_refs import map_tensors

    @attrs.frozen(kw_only=True)
    class Prepared:
        q: torch.Tensor
        scale: float = attrs.field(default=1.0)

    Pair = collections.namedtuple("Pair", "a b")
    t = [torch.tensor(i) for i in range(7)]
    value = (t[1], [t[2], {"k": t[3]}], Pair(t[4], 5), Prepared(q=t[6]), "s")

    held = map_tensors(value, lambda x: x * 2)
    assert held[0] == 2 and held[1][0] == 4 and held[1][1]["k"] == 6
    assert isinstance(held[2], Pair) and held[2].a == 8 and held[2].b == 5
    assert isinstance(held[3], Prepared) and held[3].q == 12 and held[3].scale == 1.0
    assert held[4] == "s"


def test_the_cuda_backend_aliases_only_storages_its_segments_allocated() -> None:
    """What the CUDA backend holds by a non-owning alias, decided on the CPU: an in-place output
    or a view of outside memory is outside memory (held strongly, or it could dangle), and a
    produced storage is forgotten once it is freed."""
    produced = AllocationSites()
    outside = torch.ones(4)
    with torch.inference_mode(), _SegmentWatch(produced):
        made = outside * 2
        view_of_made = made[1:]
        in_place = outside.add_(1)
        view = outside[1:]
        gone = outside + 3
    assert produced.site_of(made) is not None and produced.site_of(view_of_made) is not None
    assert produced.site_of(in_place) is None and produced.site_of(view) is None
    assert produced.site_of(gone) is not None
    del gone
    assert produced.site_of(torch.ones(4)) is None


@pytest.mark.cuda
def test_an_eager_break_at_capture_sees_replayed_values_on_the_gpu() -> None:
    """Recording is not execution: without the capture-time replay the break would read stale
    pool bytes."""
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    seen: list[torch.Tensor] = []

    @eager_break_during_capture
    def observe(y: torch.Tensor) -> None:
        seen.append(y.clone())

    backend = CudaGraphBackend(device="cuda")
    backend.warm_up(lambda: observe(x + 1))
    seen.clear()
    with BreakableCapture(backend):
        observe(x + 1)
    torch.cuda.synchronize()
    assert torch.equal(seen[0].cpu(), torch.arange(8, dtype=torch.float32) + 1)


@pytest.mark.cuda
def test_a_retired_pool_is_refused_on_the_gpu() -> None:
    import gc

    from graphs import CaptureError

    backend = CudaGraphBackend(device="cuda")
    x = torch.ones(4, device="cuda")
    gc.disable()
    try:
        with BreakableCapture(backend) as capture:
            _ = x * 2
        del capture
        assert backend.pool.graphs.retired
        with pytest.raises(CaptureError, match="retired"), BreakableCapture(backend):
            _ = x * 3
    finally:
        gc.enable()


@pytest.mark.cuda
def test_a_failed_begin_or_end_restores_the_callers_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = CudaGraphBackend(device="cuda")
    caller = torch.cuda.current_stream()
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda.CUDAGraph, "capture_begin", _raise_runtime_error)
        with pytest.raises(RuntimeError, match="injected"):
            backend.begin_segment()
    assert torch.cuda.current_stream() == caller
    backend.begin_segment()  # not stuck "already recording"
    _ = torch.ones(4, device="cuda") * 2
    real_end = torch.cuda.CUDAGraph.capture_end

    def end_then_fail(graph: torch.cuda.CUDAGraph) -> None:
        real_end(graph)  # the capture really ends; only the report fails
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda.CUDAGraph, "capture_end", end_then_fail)
        with pytest.raises(RuntimeError, match="injected"):
            backend.end_segment()
    assert torch.cuda.current_stream() == caller


def _raise_runtime_error(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected")


@pytest.mark.cuda
def test_warm_up_runs_on_the_capture_stream() -> None:
    backend = CudaGraphBackend(device="cuda")
    streams: list[torch.cuda.Stream] = []
    backend.warm_up(lambda: streams.append(torch.cuda.current_stream()))
    assert streams == [backend._stream]
    assert torch.cuda.current_stream() != backend._stream


@pytest.mark.cuda
def test_warm_up_leaves_nothing_cached_for_its_stream() -> None:
    """The caching allocator keeps a freed block for the stream that used it: warm-up's
    activations would stay reserved on the side stream, seen by no capture plan."""
    backend = CudaGraphBackend(device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    backend.warm_up(lambda: torch.ones(64 << 20, dtype=torch.uint8, device="cuda").sum())
    assert torch.cuda.memory_reserved() <= before


@pytest.mark.cuda
def test_eager_arguments_from_the_pool_are_aliases_and_others_are_held() -> None:
    backend = CudaGraphBackend(device="cuda")
    outside = torch.ones(4, device="cuda")
    held: list[object] = []

    @eager_break_during_capture
    def step(a: torch.Tensor, b: torch.Tensor) -> None:
        pass

    with BreakableCapture(backend) as capture:
        produced = outside * 2
        step(produced, outside)
    (eager,) = [s for s in capture.segments if not hasattr(s, "graph")]
    held.extend(eager.held_args)  # type: ignore[attr-defined]
    assert held[1] is outside  # held strongly: cannot dangle
    assert held[0] is not produced and held[0].data_ptr() == produced.data_ptr()  # type: ignore[attr-defined]


@pytest.mark.cuda
def test_a_capture_that_starts_with_an_eager_break_on_the_gpu() -> None:
    """The fresh pool's first graph records nothing; dropped, it would give back the pool's
    only use and the next segment's capture_begin would assert use_count > 0."""
    x, mid = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")

    @eager_break_during_capture
    def first(y: torch.Tensor) -> None:
        mid.copy_(y + 1)

    backend = CudaGraphBackend(device="cuda")
    backend.warm_up(lambda: mid * 3)
    with BreakableCapture(backend) as capture:
        first(x)
        out = mid * 3
    assert capture.layout == "EG"
    x.fill_(2.0)
    capture.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.full((4,), 9.0))
