"""The native CPU kernels (``dsv4/_kernels.c``), found and loaded once, with ctypes.

The project's install builds them as an optional extension (``pyproject.toml``): without a C
compiler the install still succeeds and the operators keep their composites, which compute the
same values bit for bit, only slower (``reason`` says why the kernels are absent). Nothing here
imports torch's C++ API: the library takes raw pointers and sizes, and each operator checks
dtype, device and layout before it hands a tensor over.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

__all__ = ["KERNELS", "reason"]


def _load() -> tuple[ctypes.CDLL | None, str]:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.exists():
            try:
                library = ctypes.CDLL(str(path))
            except OSError as error:
                return None, f"{path.name} did not load: {error}"
            sinkhorn = library.dsv4_sinkhorn_f32
            sinkhorn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
            sinkhorn.restype = None
            rms_norm = library.dsv4_rms_norm_f32
            rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
            rms_norm.restype = None
            return library, f"loaded {path.name}"
    return None, "not built (the install found no C compiler); the composites run instead"


KERNELS, reason = _load()
"""The loaded library (``None`` when absent) and a line saying what happened."""
