"""Which x86 instruction set the CPU kernels use: ``DSV4_KERNEL_ISA=avx512|avx2|baseline``.

Unset, every library picks the widest the CPU has. Set, it caps all of them at once, as a CPU
that has no wider one would: the project's native kernels (``dsv4/_kernels.c``), ATen's
vectorized kernels (``ATEN_CPU_CAPABILITY``), MKL (``MKL_ENABLE_INSTRUCTIONS``) and oneDNN
(``ONEDNN_MAX_CPU_ISA``). So an AVX-512 host runs what an AVX2-only host or a baseline x86-64
host runs, and the tests compare the bits of each (``tests/dsv4/test_isas.py``). A value the
CPU lacks is refused (``KernelIsaError``), as is an unknown one.

This module imports nothing heavy: the console entry point (``dsv4_cli``) applies the choice
before torch is imported, since torch and its libraries read their switches once, at their
first use. ``dsv4.native`` applies it again for library users and checks that torch obeyed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "ISAS",
    "KERNEL_ISA",
    "TORCH_CAPABILITY",
    "KernelIsaError",
    "apply_requested",
    "cpu_isas",
    "environment_for",
    "requested",
]

KERNEL_ISA = "DSV4_KERNEL_ISA"
"""The environment variable that names the instruction set."""

ISAS = ("baseline", "avx2", "avx512")
"""The instruction sets, narrowest first: x86-64 without AVX, AVX2 with FMA, AVX-512F. Their
index is the native library's level (``dsv4_select_isa``)."""

TORCH_CAPABILITY = {"baseline": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}
"""What ``torch.backends.cpu.get_cpu_capability()`` reports under each."""

_LIBRARY_SWITCHES = {
    "baseline": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    },
}
"""The switches torch's CPU libraries read once, at first use, for each instruction set."""


class KernelIsaError(ValueError):
    """``DSV4_KERNEL_ISA`` names an unknown instruction set, one the CPU lacks, or one torch
    can no longer take (it chose its kernels before the variable was applied)."""


def cpu_isas(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The instruction sets of ``ISAS`` this CPU has, narrowest first (every x86-64 CPU has the
    baseline). Read from the kernel's CPU flags; where there are none (not Linux), all of them:
    the native library then refuses what the CPU lacks (``dsv4.native``)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return ISAS
    has = ["baseline"]
    if {"avx2", "fma"} <= flags:
        has.append("avx2")
        if "avx512f" in flags:
            has.append("avx512")
    return tuple(has)


def requested(environ: dict[str, str] | None = None) -> str | None:
    """The instruction set ``DSV4_KERNEL_ISA`` names (``None`` where unset or empty), checked
    against ``ISAS`` and ``cpu_isas``."""
    value = (os.environ if environ is None else environ).get(KERNEL_ISA, "").strip().lower()
    if not value:
        return None
    if value not in ISAS:
        raise KernelIsaError(f"{KERNEL_ISA}={value!r} is unknown: choose one of {', '.join(ISAS)}")
    available = cpu_isas()
    if value not in available:
        raise KernelIsaError(
            f"{KERNEL_ISA}={value}: this CPU lacks it (it has {', '.join(available)})"
        )
    return value


def environment_for(isa: str) -> dict[str, str]:
    """The environment variables that cap torch's CPU libraries at ``isa``, and name it for the
    native kernels: for a child process that must run as a CPU with ``isa`` at most would."""
    return {KERNEL_ISA: isa, **_LIBRARY_SWITCHES[isa]}


def apply_requested() -> str | None:
    """Set ``environment_for`` the requested instruction set in this process's environment
    (before torch's libraries first run, it caps them); return it, or ``None`` where none is
    requested (nothing is changed)."""
    isa = requested()
    if isa is not None:
        os.environ.update(environment_for(isa))
    return isa
