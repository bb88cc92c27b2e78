"""``CudaPlatform``: NVIDIA GPUs through CUDA graphs, and ``CudaApiPlatform``, the device part it
shares with ROCm (torch's ``cuda`` API).

CUDA graphs replay captured kernels against fixed addresses, so the platform itself requires no
eager region (FULL graphs are possible wherever the runner allows them) and excludes nothing from
the ``ModelRunnerV2`` default. Parallel workers talk over ``nccl``, whose collectives are kernels
on the capturing stream: they are recorded into the graph segments like any other kernel, so a
parallel run keeps its FULL graphs.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from graphs.backend import GraphBackend
from graphs.cuda_backend import CudaGraphBackend, CudaGraphPool
from graphs.strategies import FullGraph
from platforms.base import Platform

__all__ = ["CudaApiPlatform", "CudaPlatform"]


class CudaApiPlatform(Platform):
    """The device part of a GPU platform driven through torch's ``cuda`` API (CUDA and ROCm
    builds alike): graphs recorded by ``CudaGraphBackend`` into a fresh ``CudaGraphPool``.

    Subclasses set ``name``, the reasons, and ``hip``: whether the platform runs on a ROCm (HIP)
    build of torch (``True``) or on a CUDA one (``False``); it is available only on that build
    with a GPU torch sees. The policy defaults to requiring nothing: FULL graphs, no exclusions,
    and collectives captured (``nccl``, which ROCm builds of torch serve with RCCL).
    """

    device_type = "cuda"
    eager_region_strategy = FullGraph()
    v2_excluded_architectures: frozenset[str] = frozenset()
    collectives_capturable = True
    distributed_backend = "nccl"
    hip: ClassVar[bool]

    def is_available(self) -> bool:
        return (torch.version.hip is not None) == self.hip and torch.cuda.is_available()

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        """bfloat16 needs native support (CUDA compute capability 8.0 or newer, or a ROCm GPU
        that has it); asked of an unavailable platform, nothing is refused."""
        if not self.is_available() or dtype != torch.bfloat16:
            return None
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return None
        return f"{torch.cuda.get_device_name()} has no native bfloat16 support"

    def create_memory_pool(self) -> CudaGraphPool:
        return CudaGraphPool()

    def create_graph_backend(self, pool: CudaGraphPool) -> GraphBackend:
        return CudaGraphBackend(device=self.device, pool=pool)


class CudaPlatform(CudaApiPlatform):
    """NVIDIA CUDA: available when torch sees a GPU and is not a ROCm (HIP) build."""

    name = "cuda"
    hip = False
    eager_region_reason = (
        "platform cuda requires nothing: CUDA graphs replay against fixed addresses"
    )

    @property
    def collectives_reason(self) -> str:
        return (
            f"platform {self.name} can capture nccl collectives into a graph: NCCL kernels run "
            "on the capturing stream and are recorded into CUDA graphs like any other kernel"
        )

    def unavailable_reason(self) -> str:
        if torch.version.hip is not None:
            return "this torch is a ROCm build; use the rocm platform"
        return "torch sees no CUDA GPU"
