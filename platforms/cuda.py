"""``CudaPlatform``: NVIDIA GPUs through CUDA graphs.

CUDA graphs replay captured kernels against fixed addresses, so the platform itself requires no
eager region (FULL graphs are possible wherever the runner allows them) and excludes nothing from
the ``ModelRunnerV2`` default.
"""

from __future__ import annotations

from typing import Any

import torch

from graphs.backend import GraphBackend
from graphs.strategies import FullGraph
from platforms.base import Platform

__all__ = ["CudaPlatform", "cuda_graph_backend", "cuda_graph_pool", "gpu_dtype_reason"]


def cuda_graph_pool() -> Any:
    """A fresh CUDA graph memory pool (shared by every capture of one backend)."""
    from graphs.cuda_backend import CudaGraphPool

    return CudaGraphPool()


def cuda_graph_backend(device: torch.device, pool: Any) -> GraphBackend:
    """The CUDA graph backend on ``device`` recording into ``pool`` (imported lazily)."""
    from graphs.cuda_backend import CudaGraphBackend

    return CudaGraphBackend(device=device, pool=pool)


def gpu_dtype_reason(dtype: torch.dtype) -> str | None:
    """Why the current GPU cannot compute in ``dtype`` (bfloat16 needs native support: CUDA
    compute capability 8.0 or newer, or a ROCm GPU that has it); ``None`` when it can."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        return f"{torch.cuda.get_device_name()} has no native bfloat16 support"
    return None


class CudaPlatform(Platform):
    """NVIDIA CUDA: available when torch sees a GPU and is not a ROCm (HIP) build."""

    name = "cuda"
    device_type = "cuda"
    eager_region_strategy = FullGraph()
    eager_region_reason = (
        "platform cuda requires nothing: CUDA graphs replay against fixed addresses"
    )
    v2_excluded_architectures: frozenset[str] = frozenset()

    def is_available(self) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.hip is not None:
            return "this torch is a ROCm build; use the rocm platform"
        return "torch sees no CUDA GPU"

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        return gpu_dtype_reason(dtype) if self.is_available() else None

    def create_memory_pool(self) -> Any:
        return cuda_graph_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return cuda_graph_backend(self.device, pool)
