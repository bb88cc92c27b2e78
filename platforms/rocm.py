"""``RocmPlatform``: AMD GPUs through HIP graphs (torch's ``cuda`` API on a ROCm build).

ROCm builds of torch report the device type ``cuda`` and set ``torch.version.hip``. The platform
excludes ``DeepseekV4ForCausalLM`` from the ``ModelRunnerV2`` default: on ROCm the older runner
was measured faster for that model (REFERENCE §A). That is a performance default, not a
correctness one — an explicit runner choice still wins.
"""

from __future__ import annotations

from typing import Any

import torch

from graphs.backend import GraphBackend
from graphs.strategies import FullGraph
from platforms.base import Platform
from platforms.cuda import cuda_graph_backend, cuda_graph_pool, gpu_dtype_reason

__all__ = ["RocmPlatform"]


class RocmPlatform(Platform):
    """AMD ROCm: available when torch is a HIP build and sees a GPU."""

    name = "rocm"
    device_type = "cuda"
    eager_region_strategy = FullGraph()
    eager_region_reason = (
        "platform rocm requires nothing: HIP graphs replay against fixed addresses"
    )
    v2_excluded_architectures = frozenset({"DeepseekV4ForCausalLM"})

    def v2_exclusion_reason(self, architecture: str) -> str:
        return (
            f"platform rocm excludes {architecture} from the ModelRunnerV2 default: "
            "ModelRunnerV1 is the faster runner for it on ROCm (a performance default)"
        )

    def is_available(self) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.hip is None:
            return "this torch is not a ROCm (HIP) build"
        return "torch sees no ROCm GPU"

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        return gpu_dtype_reason(dtype) if self.is_available() else None

    def create_memory_pool(self) -> Any:
        return cuda_graph_pool()

    def create_graph_backend(self, pool: Any) -> GraphBackend:
        return cuda_graph_backend(self.device, pool)
