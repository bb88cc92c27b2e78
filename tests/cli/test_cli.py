"""The ``dsv4`` CLI contract (DESIGN §7): JSON on stdout, one-line errors, equal-to-eager runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runners.cli.main import main

FAST = ["--capture-sizes", "1,2,4", "--threads", "1"]
EAGER = ["--cudagraph-mode", "NONE", "--threads", "1"]  # what is under test is not capture
CPU = ["--platform", "cpu"]  # what these tests assert is CPU behaviour, even on a GPU host


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "exactly one JSON object on one line"
    return json.loads(out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("dsv4")
    assert "Traceback" not in captured.err
    return code, lines[0]


def test_run_json_contract_and_graphs_equal_eager(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["--prompt-ids", "1,2,3,4,5,6,7", "--prompt-ids", "9,8", "--max-new-tokens", "5"]
    graphs = _json(capsys, ["run", *prompts, *FAST, *CPU])
    eager = _json(capsys, ["run", *prompts, *FAST, *CPU, "--cudagraph-mode", "NONE"])
    for key in (
        "platform",
        "runner",
        "cudagraph_mode",
        "eager_region",
        "reasons",
        "outputs",
        "graphs",
        "timing",
    ):
        assert key in graphs
    assert graphs["platform"] == "cpu"
    assert graphs["runner"] == "v2"
    assert graphs["cudagraph_mode"] == {"decode": "FULL", "mixed": "PIECEWISE"}
    assert graphs["eager_region"] == "narrow"
    assert graphs["graphs"]["captured_sizes"] == [1, 2, 4]
    assert graphs["graphs"]["num_graphs"] > 0 and graphs["graphs"]["num_eager_breaks"] > 0
    assert eager["graphs"]["num_graphs"] == 0
    assert [o["prompt_ids"] for o in graphs["outputs"]] == [[1, 2, 3, 4, 5, 6, 7], [9, 8]]
    assert all(len(o["output_ids"]) == 5 for o in graphs["outputs"])
    assert graphs["outputs"] == eager["outputs"]


def test_simulated_rocm_runs_v1_wide(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["--prompt", "hi", "--max-new-tokens", "3", "--ignore-eos"]
    rocm = _json(capsys, ["run", "--platform", "rocm", "--simulate", *prompts, *FAST])
    assert (rocm["platform"], rocm["simulated"], rocm["runner"]) == ("rocm", True, "v1")
    assert rocm["eager_region"] == "wide"
    assert rocm["cudagraph_mode"] == {"decode": "PIECEWISE", "mixed": "PIECEWISE"}
    eager = _json(capsys, ["run", "--cudagraph-mode", "NONE", *prompts, *FAST, *CPU])
    assert rocm["outputs"] == eager["outputs"]
    assert rocm["outputs"][0]["prompt_ids"] == list(b"hi")


@pytest.mark.parametrize(
    ("platform", "runner", "region"), [("cuda", "v2", "narrow"), ("rocm", "v1", "wide")]
)
def test_explain_every_platform_anywhere(
    capsys: pytest.CaptureFixture[str], platform: str, runner: str, region: str
) -> None:
    payload = _json(capsys, ["explain", "--platform", platform])
    assert (payload["runner"], payload["eager_region"]) == (runner, region)
    assert payload["reasons"]
    assert main(["explain", "--platform", platform]) == 0
    text = capsys.readouterr().out
    assert f"runner         {runner}" in text and "reasons:" in text


def test_explain_v1_full_is_downgraded_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    payload = _json(
        capsys, ["explain", "--platform", "cuda", "--runner", "v1", "--cudagraph-mode", "FULL"]
    )
    assert payload["cudagraph_mode"] == {"decode": "PIECEWISE", "mixed": "PIECEWISE"}
    assert any("FULL downgraded to PIECEWISE" in r for r in payload["reasons"])


def test_init_checkpoint_then_run_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    made = _json(capsys, ["init-checkpoint", str(ckpt), "--preset", "tiny", "--seed", "0"])
    assert made["files"] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    prompts = ["--prompt-ids", "5,6,7", "--max-new-tokens", "4"]
    from_ckpt = _json(capsys, ["run", "--checkpoint", str(ckpt), *prompts, *EAGER, *CPU])
    builtin = _json(capsys, ["run", *prompts, *EAGER, *CPU])
    texts = [o.pop("text") for o in from_ckpt["outputs"]]  # the checkpoint has a tokenizer
    assert from_ckpt["outputs"] == builtin["outputs"], "seed 0 is the built-in model's weights"
    assert all(isinstance(text, str) for text in texts)
    code, line = _error(capsys, ["init-checkpoint", str(ckpt)])
    assert code == 2 and "--force" in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "--bogus"], "unrecognized arguments"),
        (["frobnicate"], "invalid choice"),
        ([], "a command is required"),
        (["run", "--runner", "v3"], "invalid choice"),
        (["run", "--cudagraph-mode", "HALF"], "invalid choice"),
        (["run", "--eager-region", "medium"], "invalid choice"),
        (["run", "--prompt", ""], "--prompt is empty"),
        (["run"], "no prompt given"),
        (["run", "--prompt-ids", "1,x,3"], "'x' is not an integer"),
        (["run", "--prompt-ids", "1,-3"], "argument --prompt-ids: token ids are >= 0, got -3"),
        (["run", "--prompt-ids", "1,2", "--capture-sizes", "0,2"], "--capture-sizes: values"),
        (["run", "--prompt-ids", "1,2", "--platform", "tpu"], "unknown platform 'tpu'"),
        (["run", "--prompt-ids", "1,99999"], "--prompt-ids/--prompt: "),
        (["run", "--prompt-ids", ",".join(["1"] * 1100)], "--prompt-ids/--prompt/--max-new-tokens"),
        (["run", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
        (["run", "--prompt-ids", "1", "--top-k", "-1"], "argument --top-k: must be >= 0"),
        (["explain"], "--platform"),
        (["init-checkpoint", "x", "--preset", "huge"], "argument --preset: invalid choice"),
        (["bench", "--batch-sizes", "0"], "argument --batch-sizes: values must be >= 1"),
        (["bench", "--repeats", "0"], "argument --repeats: must be >= 1"),
        (["bench", "--platform", "tpu"], "unknown platform 'tpu'"),
        (["matrix", "--platform", "tpu"], "unknown platform 'tpu'"),
        (["matrix", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    ],
)
def test_every_bad_flag_value_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, line = _error(capsys, argv)
    assert code == 2
    assert needle in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        pytest.param(
            ["run", "--prompt-ids", "1,2", "--platform", "cuda"],
            "not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here"),
        ),
        (["run", "--prompt-ids", "1", "--runner", "v1", "--eager-region", "narrow"], "wide"),
    ],
)
def test_a_refused_run_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, line = _error(capsys, argv)
    assert code == 1
    assert needle in line


@pytest.mark.parametrize("broken", ["missing", "no-config", "bad-json", "truncated"])
def test_missing_or_broken_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    ckpt = tmp_path / "ckpt"
    if broken != "missing":
        assert main(["init-checkpoint", str(ckpt)]) == 0
        capsys.readouterr()
    if broken == "no-config":
        (ckpt / "config.json").unlink()
    elif broken == "bad-json":
        (ckpt / "config.json").write_text("{not json")
    elif broken == "truncated":
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    code, line = _error(capsys, ["run", "--checkpoint", str(ckpt), "--prompt-ids", "1,2"])
    assert code == 1
    assert str(ckpt) in line or "safetensors" in line or "config" in line


def test_help_explains_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "explain", "matrix", "bench", "bench-load", "init-checkpoint"):
        assert command in out


def test_a_reader_that_closes_stdout_early_stops_the_command_quietly() -> None:
    """``dsv4 explain | head``: the reader is gone before the command writes; no traceback, no
    error line, and the status a shell reports for a writer a closed pipe stopped (a process of
    its own: what matters is also what the interpreter says when it exits)."""
    read, write = os.pipe()
    os.close(read)
    argv = [sys.executable, "-m", "runners.cli.main", "explain", "--platform", "rocm"]
    try:
        result = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_seeded_sampling_reproduces_and_differs_from_greedy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["run", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--ignore-eos", *EAGER, *CPU]
    sampled = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "7"]
    first = _json(capsys, [*base, *sampled])["outputs"]
    again = _json(capsys, [*base, *sampled])["outputs"]
    greedy = _json(capsys, base)["outputs"]
    assert first == again
    assert first != greedy
