"""The same bits on every instruction set: each one this CPU has (``dsv4_isa.cpu_isas``; on an
AVX-512 host avx512, avx2 and baseline) runs ``isa_run`` in a process of its own, as a CPU
without the wider ones would (``DSV4_KERNEL_ISA``: the native kernels, ATen, MKL and oneDNN
capped together). Within each, every equal cell of the matrix is equal bit for bit and every
token budget gives the same tokens and logits; across them, every logit, every matrix cell,
every tie run and every docs example's output is the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dsv4_isa
from tests.readme.examples import comparable, examples

ROOT = Path(__file__).resolve().parents[2]
ISAS = dsv4_isa.cpu_isas()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``isa_run``'s results under every instruction set the CPU has, by name."""
    scratch = tmp_path_factory.mktemp("isas")
    results = {}
    for isa in ISAS:
        env = {**os.environ, **dsv4_isa.environment_for(isa)}
        out = scratch / f"{isa}.pt"
        subprocess.run(
            [sys.executable, "-m", "tests.dsv4.isa_run", str(out)],
            env=env,
            check=True,
            cwd=ROOT,
            timeout=600,
        )
        results[isa] = torch.load(out)
    return results


def test_each_isa_runs_as_it_was_asked_to(runs: dict[str, dict[str, Any]]) -> None:
    for isa, run in runs.items():
        assert run["isa"] == isa
        assert run["capability"] == dsv4_isa.TORCH_CAPABILITY[isa]


def test_on_every_isa_each_equal_matrix_cell_is_equal_bit_for_bit(
    runs: dict[str, dict[str, Any]],
) -> None:
    for isa, run in runs.items():
        equal = [c for c in run["matrix"] if c["status"] == "equal"]
        assert len(equal) >= 20, isa
        assert [c for c in equal if c["max_abs_diff"] != 0.0] == [], isa
        assert all(c["status"] in ("equal", "refused") for c in run["matrix"]), isa


def test_on_every_isa_every_budget_gives_the_same_tokens_and_logits(
    runs: dict[str, dict[str, Any]],
) -> None:
    for isa, run in runs.items():
        ties = run["ties"]
        for dtype in ("torch.float32", "torch.bfloat16"):
            mine = [v for k, v in ties.items() if k.startswith(dtype)]
            first_tokens, first_logits = mine[0]
            for tokens, logits in mine:
                assert tokens[0] == first_tokens[0], (isa, dtype)
                assert torch.equal(logits, first_logits), (isa, dtype)


def test_every_logit_and_output_is_the_same_on_every_isa(
    runs: dict[str, dict[str, Any]],
) -> None:
    if len(runs) < 2:
        pytest.skip(f"the CPU has one instruction set of {dsv4_isa.ISAS}: {ISAS}")
    widest, *others = runs.values()
    for run in others:
        for mine, theirs in zip(run["steps"], widest["steps"], strict=True):
            assert len(mine) == len(theirs) > 4
            for a, b in zip(mine, theirs, strict=True):
                assert bool(torch.isfinite(a).all())
                assert torch.equal(a, b), run["isa"]
        assert run["matrix"] == widest["matrix"]
        assert run["ties"].keys() == widest["ties"].keys()
        for key, (tokens, logits) in run["ties"].items():
            assert tokens == widest["ties"][key][0], (run["isa"], key)
            assert torch.equal(logits, widest["ties"][key][1]), (run["isa"], key)
        assert run["docs"] == widest["docs"], run["isa"]


def test_the_docs_show_what_every_isa_prints(runs: dict[str, dict[str, Any]]) -> None:
    shown = {f"{e.block.where} {e.line}": comparable(e.shown) for e in examples()}
    for isa, run in runs.items():
        stale = [key for key, text in run["docs"].items() if text != shown[key]]
        assert stale == [], f"{isa}: regenerate with python -m tests.readme.examples --write"


def test_an_isa_the_cpu_lacks_or_an_unknown_one_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    lacking = [isa for isa in dsv4_isa.ISAS if isa not in ISAS]
    for value, expected in [("avx9", "is unknown")] + [(isa, "lacks it") for isa in lacking]:
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                "import dsv4_cli, sys; sys.argv = ['dsv4', 'explain']; "
                "raise SystemExit(dsv4_cli.main())",
            ],
            env={**os.environ, dsv4_isa.KERNEL_ISA: value},
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and value in lines[0], result.stderr


def test_torch_that_already_chose_its_kernels_is_refused() -> None:
    script = (
        "import torch; torch.ones(3).exp(); import os; "
        f"os.environ['{dsv4_isa.KERNEL_ISA}'] = 'baseline'; import dsv4"
    )
    switches = dsv4_isa.environment_for("baseline")
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in switches},
    )
    assert result.returncode != 0
    assert "torch already runs its" in result.stderr.strip().splitlines()[-1]


def test_the_cpu_flags_decide_which_isas_there_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    for flags, expected in [
        ("fpu sse2 sse4_2", ("baseline",)),
        ("sse2 avx avx2", ("baseline",)),  # AVX2 without FMA: the kernels need both
        ("sse2 avx2 fma", ("baseline", "avx2")),
        ("sse2 avx2 fma avx512f avx512bw", dsv4_isa.ISAS),
    ]:
        cpuinfo.write_text(f"processor : 0\nflags : {flags}\n")
        assert dsv4_isa.cpu_isas(cpuinfo) == expected
    monkeypatch.setattr(dsv4_isa, "cpu_isas", lambda: ("baseline", "avx2"))
    assert dsv4_isa.requested({dsv4_isa.KERNEL_ISA: " AVX2 "}) == "avx2"
    assert dsv4_isa.requested({dsv4_isa.KERNEL_ISA: ""}) is None
    with pytest.raises(dsv4_isa.KernelIsaError, match=r"lacks it \(it has baseline, avx2\)"):
        dsv4_isa.requested({dsv4_isa.KERNEL_ISA: "avx512"})
