"""``CudaGraphBackend``: graph segments recorded as ``torch.cuda.CUDAGraph`` objects.

Invariants:
- Every segment of every capture recorded by one backend instance shares one memory pool
  (``CudaGraphPool``), so captures of several sizes reuse the same memory when captured largest
  size first. A retired pool (all its graphs gone) is never recorded into again: torch's
  allocator would assert ``use_count > 0`` if a block still lived in it.
- Segments are captured on a side stream of the backend's device; ``warm_up`` runs eager work on
  that same stream first, so library workspaces created lazily per (handle, stream) — cuBLAS's,
  hipBLASLt's — are created outside every graph's pool; the activations it freed are then
  released (they stay cached for the side stream otherwise, memory no capture plan sees).
- A segment that issued no ATen op is not a segment of the capture, but its graph is kept as
  long as the backend: its ``capture_begin`` took a use of the pool that its destructor would
  give back, and if it was the pool's first graph (a capture that begins with an eager break)
  the pool would be left at zero uses and the next ``capture_begin`` would assert
  (``use_count > 0``).
- ``begin_segment``, ``end_segment`` and ``abort_segment`` are exception-safe: the backend's
  state is stored only once capture has begun, and the caller's stream is current again after
  any of them, whatever raised.
- Eager-segment tensor arguments whose storage a segment of this backend allocated live in the
  graph pool, which keeps them reserved for replay: they are held by non-owning aliases, built
  once at capture, so holding them does not keep pool blocks allocated. Storages are told by
  identity, held weakly (an entry dies with its storage, so a later allocation at the same
  address is not mistaken for one), and only new allocations count: an in-place output or a
  view of outside memory is outside memory. Every other argument is held strongly, so none can
  dangle (the capture audit reports such arguments all the same: replay would re-run the break
  on their capture-time value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from graphs._ops import QuietDispatchMode
from graphs._tensor_refs import map_tensors
from graphs.allocations import AllocationSites, new_allocations
from graphs.backend import PoolGraphs, PoolUse
from graphs.errors import BackendUnavailableError, CaptureError

__all__ = ["CudaGraphBackend", "CudaGraphPool", "CudaGraphSegment"]


class CudaGraphPool:
    """A CUDA graph memory pool handle and the graphs recorded into it."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.graphs = PoolGraphs()

    @property
    def nbytes(self) -> None:
        """Unknown: torch reports no per-pool byte count."""
        return None

    def __repr__(self) -> str:
        return f"CudaGraphPool(handle={self.handle}, live_graphs={self.graphs.num_live})"


class _SegmentWatch(QuietDispatchMode):
    """Counts the ATen ops a segment issues and notes, by storage identity, the storages they
    allocate (outputs no input shares: not in-place outputs, not views of outside memory)."""

    def __init__(self, produced: AllocationSites) -> None:
        super().__init__()
        self.count = 0
        self.produced = produced

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self.count += 1
        result = func(*args, **kwargs)
        for t in new_allocations(func, args, kwargs, result):
            self.produced.add(t, str(func))
        return result


@attrs.frozen
class CudaGraphSegment:
    """One captured CUDA graph."""

    graph: torch.cuda.CUDAGraph
    use: PoolUse
    """The pool use the graph's ``capture_begin`` took (given back with it)."""

    def replay(self) -> None:
        self.graph.replay()


def _non_owning_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory that does not keep that memory allocated."""
    storage = tensor.untyped_storage()
    memory = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(memory, tensor.storage_offset(), tensor.shape, tensor.stride())
    return alias


class CudaGraphBackend:
    """Records segments with ``torch.cuda.CUDAGraph`` into one shared memory pool."""

    name = "cuda-graph"

    def __init__(
        self, *, device: torch.device | str = "cuda", pool: CudaGraphPool | None = None
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "the CUDA graph backend needs a CUDA GPU and none is available on this machine; "
                "use the tape backend (device 'cpu') or simulate the platform"
            )
        self.device = torch.device(device)
        self._pool = pool if pool is not None else CudaGraphPool()
        self._stream = torch.cuda.Stream(device=self.device)
        self._produced = AllocationSites()
        """Storages this backend's segments allocated (all in its pool), held weakly."""
        self._recording: tuple[torch.cuda.CUDAGraph, Any, _SegmentWatch, PoolUse] | None = None
        self._empty: list[tuple[torch.cuda.CUDAGraph, PoolUse]] = []
        """Graphs that recorded nothing: kept, since each holds a use of the pool (see the
        module docstring)."""

    @property
    def pool(self) -> CudaGraphPool:
        return self._pool

    def warm_up(self, fn: Callable[[], Any]) -> None:
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            fn()
        caller.wait_stream(self._stream)
        torch.cuda.synchronize(self.device)
        # fn's activations, freed, stay cached for the side stream (the caching allocator keeps
        # blocks per stream), where neither the graph pool nor the main stream can reuse them
        torch.cuda.empty_cache()

    def begin_segment(self) -> None:
        if self._recording is not None:
            raise CaptureError("a CUDA graph segment is already recording on this backend")
        self._pool.graphs.require_recordable()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.stream(self._stream)
        stream.__enter__()
        try:
            graph.capture_begin(pool=self._pool.handle)
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        watch = _SegmentWatch(self._produced)
        watch.__enter__()
        self._recording = (graph, stream, watch, self._pool.graphs.take())

    def end_segment(self) -> CudaGraphSegment | None:
        graph, use, issued = self._stop(aborting=False)
        if not issued:
            self._empty.append((graph, use))
            return None
        return CudaGraphSegment(graph, use)

    def abort_segment(self) -> None:
        if self._recording is not None:
            self._stop(aborting=True)

    def hold(self, value: Any) -> Any:
        """GPU tensors a segment produced become non-owning aliases (also inside containers and
        attrs values); everything else is held as it is."""
        return map_tensors(value, self._hold_tensor)

    def _hold_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda and self._produced.site_of(tensor) is not None:
            return _non_owning_alias(tensor)
        return tensor

    def _stop(self, *, aborting: bool) -> tuple[torch.cuda.CUDAGraph, PoolUse, bool]:
        if self._recording is None:
            raise CaptureError("no CUDA graph segment is recording on this backend")
        graph, stream, watch, use = self._recording
        self._recording = None
        try:
            watch.__exit__(None, None, None)
            try:
                graph.capture_end()
            except RuntimeError:
                if not aborting:
                    raise
                # an aborted capture may be invalidated already; ending it is all that matters
        finally:
            stream.__exit__(None, None, None)
        return graph, use, watch.count > 0

    def __repr__(self) -> str:
        return f"CudaGraphBackend(device={self.device}, pool={self._pool!r})"
