"""``--dtype`` on the CLI: every graph mode in bfloat16 equals its eager run, ``auto`` is the
checkpoint's ``torch_dtype``, and a dtype the platform cannot compute in is one line, exit 2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from platforms import CpuPlatform, register_platform
from platforms.registry import unregister_platform
from runners.cli.main import build_parser, main
from runners.cli.run import spec_from_args
from runners.engine import SamplingParams
from runners.measure.equivalence import Status, compare_to_eager, equality_tolerance
from runners.modes import CUDAGraphMode
from runners.spec import build_model

FAST = ["--capture-sizes", "1,2,4", "--threads", "1", "--platform", "cpu"]
PROMPTS = ["--prompt-ids", "1,2,3,4,5,6,7,8,9,10,11", "--prompt-ids", "40,41", "--max-new-tokens"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", [mode.name for mode in CUDAGraphMode])
def test_bfloat16_run_equals_its_eager_run_in_every_graph_mode(
    capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    argv = ["run", *PROMPTS, "6", *FAST, "--dtype", "bfloat16", "--cudagraph-mode", mode]
    graphs = _json(capsys, argv)
    eager = _json(capsys, [*argv, "--cudagraph-mode", "NONE"])
    assert graphs["dtype"] == eager["dtype"] == "bfloat16"
    assert [o["output_ids"] for o in graphs["outputs"]] == [
        o["output_ids"] for o in eager["outputs"]
    ]
    # the same spec the command built, its logits step by step against eager
    spec = spec_from_args(build_parser().parse_args(argv))
    prompts = [list(range(1, 12)), [40, 41]]
    verdict = compare_to_eager(spec, build_model(spec), prompts, SamplingParams(max_tokens=6))
    assert verdict.status is Status.EQUAL, verdict.detail
    assert verdict.max_abs_diff is not None
    assert verdict.max_abs_diff <= equality_tolerance("cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    assert main(["init-checkpoint", str(directory), "--preset", "tiny", "--seed", "3"]) == 0
    return directory


def _with_dtype(checkpoint: Path, tmp_path: Path, **fields: str) -> Path:
    """A copy of ``checkpoint`` whose config.json also carries ``fields``."""
    directory = tmp_path / "edited"
    directory.mkdir()
    raw = json.loads((checkpoint / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **fields}))
    (directory / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    return directory


def test_auto_is_the_checkpoint_torch_dtype(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, tmp_path: Path
) -> None:
    capsys.readouterr()
    argv = ["run", *PROMPTS, "3", *FAST, "--cudagraph-mode", "NONE"]  # graphs: the test above
    assert _json(capsys, [*argv, "--checkpoint", str(checkpoint)])["dtype"] == "float32"
    edited = _with_dtype(checkpoint, tmp_path, torch_dtype="bfloat16")
    auto = _json(capsys, [*argv, "--checkpoint", str(edited)])
    explicit = _json(capsys, [*argv, "--checkpoint", str(edited), "--dtype", "bfloat16"])
    assert auto["dtype"] == "bfloat16" and auto["outputs"] == explicit["outputs"]
    assert _json(capsys, [*argv, "--checkpoint", str(edited), "--dtype", "float16"])["dtype"] == (
        "float16"
    )
    assert _json(capsys, argv)["dtype"] == "float32"  # the built-in model


class _NoHalfCpu(CpuPlatform):
    """A CPU platform whose device cannot compute in float16."""

    name = "cpu-no-half"

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        return "no float16 kernels here" if dtype == torch.float16 else None


@pytest.fixture
def no_half_platform() -> Iterator[str]:
    register_platform(_NoHalfCpu)
    try:
        yield _NoHalfCpu.name
    finally:
        unregister_platform(_NoHalfCpu.name)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and "Traceback" not in captured.err
    return code, lines[0]


def test_a_dtype_the_platform_cannot_compute_in_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], no_half_platform: str
) -> None:
    refused = ["--platform", no_half_platform, "--dtype", "float16"]
    code, line = _error(capsys, ["run", "--prompt-ids", "1,2", *refused])
    assert code == 2
    assert line == (
        "dsv4 run: error: platform cpu-no-half cannot compute in float16: no float16 kernels "
        "here; choose another compute dtype (--dtype float32|bfloat16|float16)"
    )
    code, line = _error(capsys, ["matrix", *refused])
    assert code == 2 and "cannot compute in float16" in line
    code, line = _error(capsys, ["run", "--dtype", "float64"])
    assert code == 2 and "invalid choice: 'float64'" in line


def test_every_model_building_command_takes_dtype() -> None:
    parser = build_parser()
    for command in ("run", "matrix", "bench"):
        assert parser.parse_args([command]).dtype == "auto"
        assert parser.parse_args([command, "--dtype", "bfloat16"]).dtype == "bfloat16"
