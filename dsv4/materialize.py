"""Building a model whose parameters are allocated once, in their final dtypes, uninitialised.

A loader fills every parameter from the checkpoint, so initialising them (in float32, as module
constructors do) and converting them afterwards would only cost time and, for a moment, a
float32 copy of the whole model. Instead:
- ``parameters_on_meta()`` makes every parameter registered by *this thread* while it is active
  a ``meta`` tensor (no storage; constructors' initialisers then run on nothing). Buffers are
  untouched: a module's buffers (RoPE tables, index tables) stay real and computed. Other
  threads are unaffected (the hook is gated by a thread-local flag).
- ``materialize_parameters_(model, device, dtype_of)`` replaces each ``meta`` parameter by an
  uninitialised one of ``dtype_of(qualified name)`` on ``device``, laid out as its constructor
  laid it out (its strides: the routed experts are stored columns first); a parameter shared
  by several modules (tied embeddings) stays one parameter. The result does not require gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["materialize_parameters_", "parameters_on_meta"]

_state = threading.local()


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if not getattr(_state, "active", False) or param is None or param.is_meta:
        return None
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, parameters this thread registers become ``meta`` tensors."""
    if getattr(_state, "active", False):
        yield
        return
    # torch annotates the hook as returning None, but documents (and honours) a returned parameter
    handle = register_module_parameter_registration_hook(_to_meta)  # type: ignore[arg-type]
    _state.active = True
    try:
        yield
    finally:
        _state.active = False
        handle.remove()


def materialize_parameters_(
    model: nn.Module,
    device: torch.device | str,
    dtype_of: Callable[[str], torch.dtype],
) -> None:
    """Give every ``meta`` parameter of ``model`` uninitialised storage on ``device`` in
    ``dtype_of(name)``, where ``name`` is its first qualified name."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (meta, new): keeps ids live
    for prefix, module in model.named_modules():
        for local, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                name = f"{prefix}.{local}" if prefix else local
                data = torch.empty_strided(
                    param.shape, param.stride(), dtype=dtype_of(name), device=device
                )
                made[id(param)] = (param, nn.Parameter(data, requires_grad=False))
            module._parameters[local] = made[id(param)][1]
