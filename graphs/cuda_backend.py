"""``CudaGraphBackend``: graph segments recorded as ``torch.cuda.CUDAGraph`` objects.

Invariants:
- Every segment of every capture recorded by one backend instance shares one memory pool (the
  platform's pool when one is passed), so captures of several sizes reuse the same memory, as the
  engine the seed is from does when it captures largest size first.
- Segments are captured on a side stream of the backend's device; a segment that issued no
  kernel-producing op is dropped instead of becoming an empty CUDA graph.
- Eager-segment tensor arguments on the GPU are held by non-owning aliases: the graph pool keeps
  their memory reserved for replay, and holding them must not keep it allocated otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphs.errors import BackendUnavailableError, CaptureError

__all__ = ["CudaGraphBackend", "CudaGraphSegment"]


class _OpCounter(TorchDispatchMode):
    """Counts ATen ops issued while a segment records, to drop segments that did no work."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Keep torch from importing dynamo and wrapping every op of this mode."""
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@attrs.frozen
class CudaGraphSegment:
    """One captured CUDA graph."""

    graph: torch.cuda.CUDAGraph

    def replay(self) -> None:
        self.graph.replay()


@attrs.frozen
class _WeakTensor:
    """A non-owning alias of a GPU tensor, rebuilt into a tensor at replay."""

    data_ptr: int
    nbytes: int
    dtype: torch.dtype
    device: torch.device
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _WeakTensor:
        storage = tensor.untyped_storage()
        return cls(
            data_ptr=storage.data_ptr(),
            nbytes=storage.nbytes(),
            dtype=tensor.dtype,
            device=tensor.device,
            offset=int(tensor.storage_offset()),
            size=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
        )

    def tensor(self) -> torch.Tensor:
        storage = torch._C._construct_storage_from_data_pointer(
            self.data_ptr, self.device, self.nbytes
        )
        alias = torch.empty(0, dtype=self.dtype, device=self.device)
        alias.set_(storage, self.offset, self.size, self.stride)
        return alias


def _map_members(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to each member of a tuple, list, dict or attrs instance."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(v) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(fn(v) for v in value)
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))
        return attrs.evolve(
            value, **{f.alias: fn(getattr(value, f.name)) for f in fields if f.init}
        )
    return value


class CudaGraphBackend:
    """Records segments with ``torch.cuda.CUDAGraph`` into one shared memory pool."""

    name = "cuda-graph"

    def __init__(self, *, device: torch.device | str = "cuda", pool: Any = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "the CUDA graph backend needs a CUDA GPU and none is available on this machine; "
                "use the tape backend (device 'cpu') or simulate the platform"
            )
        self.device = torch.device(device)
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_ctx: torch.cuda.graph | None = None
        self._counter: _OpCounter | None = None

    @property
    def pool(self) -> Any:
        return self._pool

    def begin_segment(self) -> None:
        if self._graph is not None:
            raise CaptureError("a CUDA graph segment is already recording on this backend")
        torch.cuda.synchronize(self.device)
        self._graph = torch.cuda.CUDAGraph()
        self._graph_ctx = torch.cuda.graph(self._graph, pool=self._pool, stream=self._stream)
        self._graph_ctx.__enter__()
        self._counter = _OpCounter()
        self._counter.__enter__()

    def end_segment(self) -> CudaGraphSegment | None:
        graph, issued = self._stop(None)
        return CudaGraphSegment(graph) if issued else None

    def abort_segment(self) -> None:
        if self._graph is not None:
            self._stop(CaptureError("capture aborted"))

    def hold(self, value: Any) -> Any:
        """GPU tensors become non-owning aliases, also inside containers and attrs values."""
        if isinstance(value, torch.Tensor) and value.is_cuda:
            return _WeakTensor.of(value)
        return _map_members(value, self.hold)

    def release(self, held: Any) -> Any:
        if isinstance(held, _WeakTensor):
            return held.tensor()
        return _map_members(held, self.release)

    def _stop(self, exc: BaseException | None) -> tuple[torch.cuda.CUDAGraph, bool]:
        graph, ctx, counter = self._graph, self._graph_ctx, self._counter
        if graph is None or ctx is None or counter is None:
            raise CaptureError("no CUDA graph segment is recording on this backend")
        self._graph = self._graph_ctx = self._counter = None
        counter.__exit__(None, None, None)
        exc_type = type(exc) if exc is not None else None
        ctx.__exit__(exc_type, exc, None)
        return graph, counter.count > 0

    def __repr__(self) -> str:
        return f"CudaGraphBackend(device={self.device})"
