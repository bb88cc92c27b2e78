"""``dsv4 matrix``: every cell equals an eager run of its own platform, on that platform's device,
within ``equality_tolerance`` of that device and the model's dtype; the matrix is a gate.

The two full CPU matrices — V1 with a region narrower than wide refused, or caught by the audit
under ``--unsafe-region``, every other cell equal to eager — are the examples of
``docs/design.md``, whose whole tables ``tests/readme/test_examples.py`` compares cell by cell
with a fresh run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import runners.cli.matrix as matrix_command
from runners.cli.main import main
from runners.measure.equivalence import equality_tolerance

TINY = ["--prompt-ids", "2,7", "--max-new-tokens", "2", "--capture-sizes", "1,2", "--threads", "1"]


def test_eager_reference_follows_the_simulated_platform(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["matrix", "--platform", "rocm", "--simulate", *TINY, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    [reference] = payload["references"]
    assert reference["platform"] == "rocm" and reference["simulated"] is True
    assert (reference["device"], reference["dtype"], reference["atol"]) == ("cpu", "float32", 5e-5)
    assert len(reference["outputs"]) == 1
    assert {(c["platform"], c["simulated"]) for c in payload["cells"]} == {("rocm", True)}
    for cell in payload["cells"]:
        assert cell["status"] in ("equal", "refused"), cell
    assert payload["counts"]["equal"] > 0


def test_human_output_names_each_reference_and_an_explicit_atol_overrides(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["matrix", "--platform", "cuda", "--simulate", *TINY, "--atol", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("cuda*") for line in lines[2:-2])
    assert lines[-1] == "eager references: cuda* on cpu, float32, atol 0.5."


@pytest.mark.parametrize(
    ("device_type", "dtype", "tolerance"),
    [
        ("cpu", torch.float32, 5e-5),
        ("cpu", torch.float64, 5e-5),
        ("cuda", torch.float32, 1e-3),
        ("cuda", torch.float64, 1e-3),
        ("xpu", torch.float32, 1e-3),
        ("cpu", torch.float16, 1e-2),
        ("cuda", torch.float16, 1e-2),
        ("cpu", torch.bfloat16, 5e-2),
        ("cuda", torch.bfloat16, 5e-2),
    ],
)
def test_equality_tolerance_rule(device_type: str, dtype: torch.dtype, tolerance: float) -> None:
    assert equality_tolerance(device_type, dtype) == tolerance


def test_equality_tolerance_refuses_a_dtype_without_a_rule() -> None:
    with pytest.raises(ValueError, match="int64"):
        equality_tolerance("cpu", torch.int64)


@pytest.mark.cuda
def test_cuda_matrix_every_allowed_cell_equals_eager_on_the_gpu() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runners.cli.main", "matrix", "--platform", "cuda", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    [reference] = payload["references"]
    assert (reference["platform"], reference["simulated"], reference["device"]) == (
        "cuda",
        False,
        "cuda",
    )
    assert reference["atol"] == equality_tolerance("cuda", torch.float32)
    for cell in payload["cells"]:
        assert (cell["platform"], cell["simulated"]) == ("cuda", False)
        if cell["status"] != "refused":
            assert cell["status"] == "equal", cell


def test_matrix_is_a_gate_failing_on_a_mismatch_unless_report_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate on a real run; then the same cells reported only (the run's payload is handed
    back instead of running the matrix again: the exit code and wording are the CLI's)."""
    # atol 0 on two threads: the native kernels take one thread only, so MKL's products run,
    # and a step padded to 128 rows sums differently from the unpadded eager step (a few 1e-6)
    argv = ["matrix", "--platform", "cpu", "--prompt-ids", "1,2,3,4,5", "--atol", "0"]
    argv += ["--max-new-tokens", "2", "--capture-sizes", "1,128", "--threads", "2"]
    assert main([*argv, "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["failed_cells"] == payload["counts"]["mismatch"] > 0
    payload.pop("report_only")
    monkeypatch.setattr(matrix_command, "run_matrix", lambda options, progress: payload)
    assert main([*argv, "--report-only"]) == 0
    assert "(reported only)" in capsys.readouterr().out


def test_matrix_refuses_a_negative_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "--platform", "cpu", "--atol", "-1"]) == 2
    assert "argument --atol: must be >= 0" in capsys.readouterr().err


def test_an_error_in_a_cell_is_reported_and_fails_the_gate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from runners.measure import equivalence

    real = equivalence.run_trace

    def broken_graphs(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        if spec.cudagraph_mode != "NONE":
            raise RuntimeError("injected kernel failure")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(equivalence, "run_trace", broken_graphs)
    argv = ["matrix", "--platform", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main([*argv, "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    errors = [c for c in payload["cells"] if c["status"] == "error"]
    assert errors and all(c["detail"] == "RuntimeError: injected kernel failure" for c in errors)


def test_matrix_passes_with_prefix_cache_hits_and_keeps_the_uncached_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The second prompt is the first's 64 tokens (the tiny model's prefix boundary at 16-token
    blocks) plus its own: in every run cell and the eager reference it finds those 64 tokens
    cached, every allowed cell is equal, and the tokens are those of a matrix without the cache."""
    shared = ",".join(str(t) for t in range(1, 65))
    argv = [
        "matrix",
        "--platform",
        "cuda",
        "--simulate",
        "--prompt-ids",
        f"{shared},65,66",
        "--prompt-ids",
        f"{shared},200,201,202",
        "--max-new-tokens",
        "2",
        "--capture-sizes",
        "1,2",
        "--threads",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    cached = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-enable-prefix-caching"]) == 0
    uncached = json.loads(capsys.readouterr().out)
    ran = [cell for cell in cached["cells"] if cell["status"] != "refused"]
    assert ran and all(cell["status"] == "equal" for cell in ran)
    assert {cell["prefix_cache_hit_tokens"] for cell in ran} == {64}
    (reference,) = cached["references"]
    assert reference["prefix_cache_hit_tokens"] == 64
    assert uncached["references"][0]["prefix_cache_hit_tokens"] == 0
    assert reference["outputs"] == uncached["references"][0]["outputs"]
