"""``dsv4 bench-load``: the peak-RSS measurement of a load is consistent with itself (ratio =
rise / model bytes, the rise at least what stays resident) and its model bytes are the loaded
model's own, counted here independently. No threshold on the ratio: it is what the README
quotes, measured, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.dtypes import dtype_name, resolve_dtype
from dsv4.quantized_writer import save_random_quantized_checkpoint
from runners.cli.main import main

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="bench-load reads /proc (Linux)"
)


def _bench_load(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runners.cli.main", "bench-load", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _own_bytes(model: torch.nn.Module) -> int:
    """Parameters (each once) plus persistent buffers, from the module tree."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                total += buffer.numel() * buffer.element_size()
    return total


@pytest.mark.parametrize(
    ("layout", "dtype", "quantization"),
    [
        ("plain", "float32", "auto"),
        ("fp8", "bfloat16", "weight-only"),
        ("fp4", "auto", "dequantize"),
    ],
)
def test_the_figures_are_consistent_and_the_model_bytes_are_the_models(
    tmp_path: Path, layout: str, dtype: str, quantization: str
) -> None:
    config = DeepseekV4Config.tiny()
    if layout == "plain":
        save_random_checkpoint(tmp_path, config, seed=1)
    else:
        save_random_quantized_checkpoint(tmp_path, config, 1, expert_dtype=layout)
    result = _bench_load(
        "--checkpoint", str(tmp_path), "--dtype", dtype, "--quantization", quantization, "--json"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    payload = json.loads(result.stdout)
    compute = resolve_dtype(dtype, tmp_path)
    model = load_checkpoint(tmp_path, dtype=compute, quantization=quantization, progress=None)
    assert payload["model_bytes"] == _own_bytes(model)
    assert payload["ratio"] == payload["peak_rss_rise_bytes"] / payload["model_bytes"]
    assert 0 < payload["retained_rss_bytes"] <= payload["peak_rss_rise_bytes"]
    assert payload["baseline_rss_bytes"] > 0 and payload["load_seconds"] > 0
    assert payload["peak_reset"] is True
    expected_mode = "none" if layout == "plain" else quantization
    assert (payload["dtype"], payload["quantization"]) == (dtype_name(compute), expected_mode)
    assert payload["checkpoint"] == str(tmp_path)


def test_the_human_form_and_a_missing_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_random_checkpoint(tmp_path / "ckpt", DeepseekV4Config.tiny(), seed=1)
    shown = _bench_load("--checkpoint", str(tmp_path / "ckpt"))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"loaded {tmp_path / 'ckpt'} (float32, quantization none) in ")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "peak RSS rise",
        "model bytes",
        "ratio",
        "still resident",
    ]
    assert main(["bench-load", "--checkpoint", str(tmp_path / "nothing")]) == 1
    missing = capsys.readouterr()
    assert missing.out == ""
    assert missing.err == (
        f"dsv4 bench-load: error: no config.json in checkpoint directory {tmp_path / 'nothing'}\n"
    )
