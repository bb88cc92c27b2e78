"""Which tensors of a simulated GPU run would live on the host: ``HostTensors``.

On a simulated platform every tensor is a CPU tensor, so ``tensor.device`` cannot say whether a
real run would have put it on the GPU. What decides it on the GPU is how the code made it: a
factory (``torch.tensor``, ``torch.zeros``, …) given no device makes a host tensor (torch's
default device is the CPU), one given a device (``device=platform.device``) or a move
(``.to(device)``) makes a device tensor, and any other op puts its result where its inputs are.
``HostTensors`` is a torch-function mode that follows exactly that and remembers, by storage,
the tensors a real run would hold on the host, with the line that made each. A backend that
serves device tensors only (NCCL) is then simulated by a group that refuses those
(``platforms.device_only_group``).

Invariants:
- A tensor is *on the host* iff its storage is remembered: made by a factory given no device, or
  by an op whose tensor inputs were all on the host. Everything else — tensors made before the
  mode started, by C++ (a checkpoint's reader), named a device, or computed from at least one
  device tensor (torch would put a 0-dim host operand beside a device tensor) — counts as on the
  device. So the mode never refuses a tensor a real run would hold on the device; what it misses
  is host data it never saw made.
- Naming a device means the platform's device: on the simulated platform that device *is* the
  CPU, so ``device="cpu"`` reads as the device too. Host tensors are made without a device.
- A move or factory that names a device clears its output's storage (on the CPU the result may
  be the host tensor itself: ``tensor.to("cpu")`` returns it).
- Entries hold their storage weakly (``graphs.allocations.AllocationSites``): tracking never
  keeps a tensor alive, and a freed storage's key is never mistaken for a new one.
- ``device_work()`` sets the mode aside (for the block, in this thread): a runner's step is work
  on the device — every tensor its model computes comes from its parameters and the runner's
  device buffers — and watching each of its calls made the built-in model's eager steps 2.4
  times slower.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphs._source import user_location
from graphs._tensor_refs import storage_key, tensors_of
from graphs.allocations import AllocationSites

__all__ = ["HostTensors", "device_work"]

_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda})
"""Methods that put a tensor on the device named in their arguments (``cuda``: always)."""


@functools.cache
def _factories() -> frozenset[Callable[..., Any]]:
    """The functions that make a tensor on torch's default device unless given ``device``
    (those ``torch.set_default_device`` redirects)."""
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


def _names_a_device(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    if kwargs.get("device") is not None or func is torch.Tensor.cuda:
        return True
    return func in _MOVES and any(isinstance(a, str | torch.device) for a in args[1:])


class HostTensors(TorchFunctionMode):
    """Remembers the tensors a real run of the code under it would make on the host."""

    def __init__(self) -> None:
        super().__init__()
        self._sites = AllocationSites()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs = tensors_of(result)
        if not outputs:
            return result
        if _names_a_device(func, args, kwargs):
            for output in outputs:
                self._sites.discard(output)
            return result
        inputs = tensors_of((args, kwargs))
        host = all(self.is_host(t) for t in inputs) if inputs else func in _factories()
        if host:
            known = {storage_key(t) for t in inputs}
            fresh = [o for o in outputs if storage_key(o) not in known]
            if fresh:
                site = f"{getattr(func, '__name__', func)} at {user_location(depth=2)}"
                for output in fresh:
                    self._sites.add(output, site)
        return result

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether a real run would hold ``tensor`` on the host (see the module docstring)."""
        return self._sites.site_of(tensor) is not None

    def site_of(self, tensor: torch.Tensor) -> str | None:
        """``"function at file:line"`` that made host tensor ``tensor``; ``None`` on the device."""
        return self._sites.site_of(tensor)


@contextlib.contextmanager
def device_work() -> Iterator[None]:
    """Set an active ``HostTensors`` aside for the block (a no-op without one): the block's
    tensors are the device's (see the module docstring); what it remembered stays."""
    depth = torch._C._len_torch_function_stack()
    if depth == 0 or not isinstance(torch._C._get_function_stack_at(depth - 1), HostTensors):
        yield
        return
    mode = torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)
