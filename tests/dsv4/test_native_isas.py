"""The native kernels compute the same bits whichever instruction set they run with: AVX-512
(and AVX2 with FMA) where the CPU has them, the baseline where ``DSV4_BASELINE_KERNELS`` is set.
Every kernel the decode path takes runs in ``isa_logits``; its logits must be equal, bit for
bit, in two processes, one per instruction set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import native

_FLAGS = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []

pytestmark = [
    pytest.mark.skipif(native.KERNELS is None, reason=native.reason),
    pytest.mark.skipif(
        "avx512f" not in _FLAGS, reason="the CPU has no AVX-512: one instruction set"
    ),
]


def _logits(tmp_path: Path, name: str, *, baseline: bool) -> list[torch.Tensor]:
    env = {k: v for k, v in os.environ.items() if k != "DSV4_BASELINE_KERNELS"}
    if baseline:
        env["DSV4_BASELINE_KERNELS"] = "1"
    out = tmp_path / f"{name}.pt"
    subprocess.run(
        [sys.executable, "-m", "tests.dsv4.isa_logits", str(out)],
        env=env,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    logits: list[torch.Tensor] = torch.load(out)
    return logits


def test_the_kernels_give_the_same_bits_on_every_instruction_set(tmp_path: Path) -> None:
    wide = _logits(tmp_path, "wide", baseline=False)
    baseline = _logits(tmp_path, "baseline", baseline=True)
    assert [t.shape[0] for t in wide] == [1, 6]
    for fast, plain in zip(wide, baseline, strict=True):
        assert bool(torch.isfinite(fast).all())
        assert torch.equal(fast, plain)
