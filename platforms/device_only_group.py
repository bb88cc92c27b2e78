"""A gloo process group that refuses host tensors, as a device-only backend (NCCL) does.

NCCL serves CUDA tensors only (``torch.distributed.Backend.backend_capability``: nccl → cuda): a
collective on a CPU tensor in an NCCL group raises ``No backend type associated with device type
cpu`` before anything is sent. gloo serves both, so a parallel run simulated on the CPU over
plain gloo accepts every tensor, and a CPU tensor that would crash every GPU run passes every
test. A simulated platform whose real backend serves no host tensors therefore runs its ranks
over ``DEVICE_ONLY_GLOO``: gloo underneath, in front of it ``DeviceOnlyGroup``, which asks the
rank's ``HostTensors`` (``platforms.host_tensors``) where a real run would hold each tensor and
refuses a host one with NCCL's own words, then where it was made.

Invariants:
- Every collective the group serves (``broadcast``, ``all_reduce``, ``all_gather_single`` and
  ``all_gather_into_tensor``, ``all_gather``, ``barrier``) checks every tensor it is given
  before this rank sends anything (ranks running the same code refuse together, as under
  NCCL); any other collective reaches torch's ``ProcessGroup``, which has no backend for CPU
  tensors here and refuses it with the same error.
- Accepted collectives are gloo's, unchanged: values and ordering are a plain gloo group's.
- ``register_device_only_backend`` (re)binds the backend name to one ``HostTensors``: call it
  right before ``init_process_group`` in the process that will use the group.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from platforms.host_tensors import HostTensors

__all__ = [
    "DEVICE_ONLY_GLOO",
    "DeviceOnlyGroup",
    "register_device_only_backend",
    "serves_host_tensors",
]

DEVICE_ONLY_GLOO = "gloo_device_only"
"""The backend name of a gloo group that refuses host tensors (``DeviceOnlyGroup``)."""


def serves_host_tensors(backend: str) -> bool:
    """Whether torch's ``backend`` takes CPU tensors (``gloo`` does, ``nccl`` does not); a
    backend torch does not know is assumed to."""
    capability = dist.Backend.backend_capability.get(backend)
    return capability is None or "cpu" in capability


_ProcessGroup: Any = dist.ProcessGroup
"""Typed loosely: torch's stubs describe the group's front-end overloads, not the
``(tensors, options) -> Work`` methods a group written in Python implements."""


class DeviceOnlyGroup(_ProcessGroup):
    """A gloo group that refuses tensors a real run would hold on the host (see the module
    docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        *,
        host: HostTensors,
    ) -> None:
        super().__init__(rank, size)
        self._gloo: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store), rank, size, timeout
        )
        self._host = host

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self._refuse_host(tensors)
        return self._gloo.broadcast(tensors, opts)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self._refuse_host(tensors)
        return self._gloo.allreduce(tensors, opts)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Any:
        self._refuse_host([output, tensor])
        return self._gloo._allgather_base(output, tensor, opts)

    _allgather_base = all_gather_single

    def allgather(
        self, outputs: list[list[torch.Tensor]], tensors: list[torch.Tensor], opts: Any
    ) -> Any:
        self._refuse_host([*tensors, *(t for row in outputs for t in row)])
        return self._gloo.allgather(outputs, tensors, opts)

    def barrier(self, opts: Any) -> Any:
        return self._gloo.barrier(opts)

    def getBackendName(self) -> str:
        return DEVICE_ONLY_GLOO

    def _refuse_host(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            site = self._host.site_of(tensor)
            if site is not None:
                raise RuntimeError(
                    "No backend type associated with device type cpu (simulated: this "
                    f"{_describe(tensor)} would be on the host, made by {site}; a device-only "
                    "backend such as NCCL serves tensors on the device)"
                )


def _describe(tensor: torch.Tensor) -> str:
    shape = ", ".join(map(str, tensor.shape))
    return f"{str(tensor.dtype).removeprefix('torch.')} tensor [{shape}]"


def register_device_only_backend(host: HostTensors) -> None:
    """Bind ``DEVICE_ONLY_GLOO`` to a ``DeviceOnlyGroup`` asking ``host`` (see the module
    docstring)."""
    dist.Backend.register_backend(
        DEVICE_ONLY_GLOO, functools.partial(DeviceOnlyGroup, host=host), devices=["cpu"]
    )
