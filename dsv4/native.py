"""The native CPU kernels (``dsv4/_kernels.c``), found and loaded once, with ctypes.

The project's install builds them as an optional extension (``pyproject.toml``): without a C
compiler the install still succeeds and the operators keep their composites, which compute the
same values bit for bit, only slower (``reason`` says why the kernels are absent). Nothing here
imports torch's C++ API: the library takes raw pointers and sizes, and each operator checks
dtype, device and layout before it hands a tensor over.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

import dsv4_isa

__all__ = ["ISA", "KERNELS", "prebound", "reason"]


_POINTER: type = ctypes.c_void_p
_SIZE: type = ctypes.c_int64
_FLOAT: type = ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "dsv4_sinkhorn_f32": [_POINTER, _SIZE, _SIZE, _SIZE],
    "dsv4_rms_norm_f32": [_POINTER] * 3 + [_SIZE] * 2 + [_FLOAT],
    "dsv4_hc_weights_f32": [_POINTER] * 6 + [_SIZE] * 2 + [_FLOAT, _SIZE],
    "dsv4_hc_collapse_f32": [_POINTER] * 3 + [_SIZE] * 3,
    "dsv4_hc_mix_f32": [_POINTER] * 4 + [_SIZE] * 3 + [_POINTER] + [_SIZE] * 3,
    "dsv4_swiglu_f32": [_POINTER, _POINTER, _SIZE, _POINTER] + [_SIZE] * 3 + [_FLOAT],
    "dsv4_rope_f32": [_POINTER] * 4 + [_SIZE, _POINTER] + [_SIZE] * 4,
    "dsv4_linear_f32": [_POINTER] * 3 + [_SIZE] * 3,
    "dsv4_grouped_linear_f32": [_POINTER] * 3 + [_SIZE] * 4,
    "dsv4_linear_panels_f32": [_POINTER] * 3 + [_SIZE] * 5,
    "dsv4_routed_experts_f32": [_POINTER] * 6 + [_SIZE] * 7 + [_FLOAT],
    "dsv4_stable_topk_f32": [_POINTER] * 2 + [_SIZE] * 3,
    "dsv4_route_f32": [_POINTER] * 6 + [_SIZE] * 4 + [_FLOAT],
    "dsv4_attend_f32": [_POINTER] * 9 + [_SIZE] * 7 + [_FLOAT, _SIZE],
    "dsv4_index_scores_f32": [_POINTER] * 5 + [_SIZE] * 4 + [_FLOAT],
    "dsv4_pool_f32": [_POINTER] * 5 + [_SIZE] * 5,
    "dsv4_hc_pre_f32": [_POINTER] * 10 + [_SIZE] * 5 + [_FLOAT] * 2 + [_SIZE],
    "dsv4_swiglu_mlp_f32": [_POINTER] * 8 + [_SIZE] * 5 + [_FLOAT],
    "dsv4_gather_rows": [_POINTER] * 3 + [_SIZE] * 3,
    "dsv4_scatter_rows": [_POINTER] * 3 + [_SIZE] * 3,
    "dsv4_sigmoid_f32": [_POINTER] * 2 + [_SIZE],
    "dsv4_cos_sin_f32": [_POINTER] * 3 + [_SIZE],
    "dsv4_cpu_isa": [],
    "dsv4_kernel_isa": [],
    "dsv4_select_isa": [_SIZE],
}
"""Each kernel's C parameters (pointers, ``int64_t`` sizes, ``float`` scalars)."""

_RETURNS: dict[str, type] = {
    name: _SIZE
    for name in (
        "dsv4_routed_experts_f32",
        "dsv4_attend_f32",
        "dsv4_route_f32",
        "dsv4_pool_f32",
        "dsv4_gather_rows",
        "dsv4_scatter_rows",
        "dsv4_cpu_isa",
        "dsv4_kernel_isa",
        "dsv4_select_isa",
    )
}
"""Kernels that return a status (0, or negative where it did nothing); the others ``void``."""


def _declare(library: ctypes.CDLL) -> None:
    for name, parameters in _SIGNATURES.items():
        kernel = getattr(library, name)
        kernel.argtypes = parameters
        kernel.restype = _RETURNS.get(name)


def _load() -> tuple[ctypes.CDLL | None, str]:
    spec = importlib.util.find_spec("dsv4._kernels")
    if spec is None or spec.origin is None:
        return None, "not built (the install found no C compiler); ATen's ops run instead"
    name = Path(spec.origin).name
    try:
        library = ctypes.CDLL(spec.origin)
        _declare(library)
    except (OSError, AttributeError) as error:  # unloadable, or built from an older source
        return None, f"{name} is unusable ({error}); reinstall the project"
    return library, f"loaded {name}"


def _select_isa(library: ctypes.CDLL | None) -> str:
    """Apply ``DSV4_KERNEL_ISA`` (``dsv4_isa``) to torch's libraries and the native kernels;
    return the instruction set the kernels use (``"baseline"`` without them). Refuses
    (``KernelIsaError``) one the CPU lacks, and one torch cannot take any more: its kernels
    were chosen, wider, before this module was imported."""
    isa = dsv4_isa.apply_requested()
    if isa is not None:
        if library is not None and library.dsv4_select_isa(dsv4_isa.ISAS.index(isa)) < 0:
            raise dsv4_isa.KernelIsaError(f"{dsv4_isa.KERNEL_ISA}={isa}: this CPU lacks it")
        chosen = torch.backends.cpu.get_cpu_capability()
        if chosen != dsv4_isa.TORCH_CAPABILITY[isa]:
            raise dsv4_isa.KernelIsaError(
                f"{dsv4_isa.KERNEL_ISA}={isa}: torch already runs its {chosen} kernels (set the "
                "variable before the process first runs a torch operator)"
            )
    return dsv4_isa.ISAS[library.dsv4_kernel_isa()] if library is not None else "baseline"


KERNELS, reason = _load()
"""The loaded library (``None`` when absent) and a line saying what happened."""

ISA = _select_isa(KERNELS)
"""The instruction set the native kernels use: the widest of ``dsv4_isa.ISAS`` the CPU has, or
the one ``DSV4_KERNEL_ISA`` names."""


def prebound(kernel: Any, *arguments: Any) -> functools.partial[Any]:
    """``kernel(*arguments)`` as a zero-argument call whose arguments were converted to their C
    types once, here (by the declared ``argtypes``, which check them), calling an unchecked
    pointer to the same function: a replayed call then converts nothing (0.35 us a call here,
    where one converting its arguments takes 0.6 us)."""
    converted = [c_type(value) for c_type, value in zip(kernel.argtypes, arguments, strict=True)]
    return functools.partial(_unchecked(kernel.__name__), *converted)


@functools.cache
def _unchecked(name: str) -> Any:
    """A second function object for kernel ``name``, without ``argtypes`` (looked up once)."""
    assert KERNELS is not None
    unchecked = KERNELS[name]
    unchecked.restype = _RETURNS.get(name)
    return unchecked
