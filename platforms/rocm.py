"""``RocmPlatform``: AMD GPUs through HIP graphs (torch's ``cuda`` API on a ROCm build).

ROCm builds of torch report the device type ``cuda`` and set ``torch.version.hip``. The platform
excludes ``DeepseekV4ForCausalLM`` from the ``ModelRunnerV2`` default: on ROCm the older runner
was measured faster for that model (REFERENCE §A). That is a performance default, not a
correctness one — an explicit runner choice still wins.

Collectives are captured as on CUDA: a ROCm build of torch serves the ``nccl`` backend with RCCL,
whose kernels run on the capturing stream and are recorded into HIP graphs like any other kernel,
so a parallel run keeps its FULL graphs.
"""

from __future__ import annotations

import torch

from platforms.cuda import CudaApiPlatform

__all__ = ["RocmPlatform"]


class RocmPlatform(CudaApiPlatform):
    """AMD ROCm: available when torch is a HIP build and sees a GPU."""

    name = "rocm"
    hip = True
    eager_region_reason = (
        "platform rocm requires nothing: HIP graphs replay against fixed addresses"
    )
    v2_excluded_architectures = frozenset({"DeepseekV4ForCausalLM"})

    @property
    def collectives_reason(self) -> str:
        return (
            f"platform {self.name} can capture nccl collectives into a graph: torch serves nccl "
            "with RCCL on ROCm, whose kernels run on the capturing stream and are recorded into "
            "HIP graphs like any other kernel"
        )

    def v2_exclusion_reason(self, architecture: str) -> str:
        return (
            f"platform rocm excludes {architecture} from the ModelRunnerV2 default: "
            "ModelRunnerV1 is the faster runner for it on ROCm (a performance default)"
        )

    def unavailable_reason(self) -> str:
        if torch.version.hip is None:
            return "this torch is not a ROCm (HIP) build"
        return "torch sees no ROCm GPU"
