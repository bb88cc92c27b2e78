"""``CudaGraphBackend``: a clear error without a GPU; the capture rules on a real GPU.

The GPU tests are behind the ``cuda`` marker and skip cleanly where no GPU is available.
"""

from __future__ import annotations

import pytest
import torch

from graphs import BackendUnavailableError, BreakableCapture, eager_break_during_capture
from graphs.capture import backend_for_device
from graphs.cuda_backend import CudaGraphBackend


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
def test_segments_of_one_backend_share_one_pool() -> None:
    backend = CudaGraphBackend(device="cuda")
    pool = backend.pool
    x = torch.ones(4, device="cuda")
    with BreakableCapture(backend) as capture:
        _ = x * 2
    assert backend.pool is pool
    assert capture.num_graphs == 1


def test_eager_arguments_are_held_member_by_member() -> None:
    """hold/release reach tensors inside tuples, named tuples, lists, dicts and attrs values."""
    import collections

    import attrs

    from graphs.cuda_backend import _map_members

    @attrs.frozen(kw_only=True)
    class Prepared:
        q: int
        scale: float = attrs.field(default=1.0)

    Pair = collections.namedtuple("Pair", "a b")
    value = (1, [2, {"k": 3}], Pair(4, 5), Prepared(q=6))

    def double(v: object) -> object:
        return v * 2 if isinstance(v, int) else _map_members(v, double)

    assert _map_members(value, double) == (2, [4, {"k": 6}], Pair(8, 10), Prepared(q=12))
