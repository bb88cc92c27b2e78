"""``dsv4 bench``: it names the platform it measured (``--platform``, ``--simulate`` as for
``run``), times every interval until the device has finished it, and prints ``n/a`` for memory a
pool does not report (CUDA's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from platforms import current_platform
from runners.cli.bench import render
from runners.cli.main import main
from runners.measure.benchmark import timed
from tests.readme.examples import command_lines, dsv4, in_directory, shell_block
from tests.readme.test_shell_examples import run_line, smoke

FAST = ["--batch-sizes", "1", "--threads", "1", "--repeats", "2", "--rounds", "1"]
FAST += ["--generate-prompts", "1", "--max-new-tokens", "2"]


def _assert_measured(payload: dict) -> None:
    [row] = payload["decode"]
    assert (row["threads"], row["batch_size"]) == (1, 1)
    assert set(row["median_us"]) == {"eager", "full", "narrow", "wide"}
    assert all(us > 0 for us in row["median_us"].values())
    assert payload["capture"]["total_s"] > 0
    assert payload["generation"]["tokens_per_s"]["engine"] > 0
    limit = payload["limit"]
    [machine] = limit["machine"]
    assert machine["threads"] == 1
    assert machine["read_bandwidth_gb_s"] > 0 and machine["empty_op_us"] > 0
    assert machine["gflops"] > 0
    [step] = limit["steps"]
    assert step["bytes"]["total"] > step["bytes"]["weights"] > 0
    assert set(step["ops"]) == set(row["median_us"])
    [floor] = limit["rows"]
    assert set(floor["x_floor"]) == set(row["median_us"])
    assert floor["compute_floor_us"] > 0
    for name, us in row["median_us"].items():  # each multiple is of the largest floor
        larger = max(
            floor["memory_floor_us"], floor["compute_floor_us"], floor["dispatch_floor_us"][name]
        )
        assert abs(floor["x_floor"][name] - us / larger) <= 0.01 * us / larger + 0.005


def test_the_documented_reproduce_commands_measure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``docs/benchmarks.md``'s reproduce block, line by line at the smoke scale of
    ``test_shell_examples`` (the tiny preset, one repeat): each names the platform it measured
    and measures what its table reports; with --vs-transformers the peer runs where the engine
    runs (on a GPU platform, the GPU: transformers' default, the CPU, would compare devices),
    and the payload names both."""
    import runners.measure.suite as suite

    asked: dict[str, object] = {}
    baseline = suite.transformers_baseline

    def spy(*args: object, **kwargs: object) -> object:
        asked.update(kwargs)
        return baseline(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(suite, "transformers_baseline", spy)
    lines = command_lines(shell_block("reproduce"))
    assert [argv[:2] for argv in lines] == [
        ["dsv4", "bench"],
        ["dsv4", "init-checkpoint"],
        ["dsv4", "bench"],
        ["dsv4", "bench"],
        ["python", "-m"],
    ]
    builtin, init, checkpoint, sweep, tape = lines
    with in_directory(tmp_path):
        payload = _json(smoke(builtin))
        run_line(smoke(init))
        from_checkpoint = _json(smoke(checkpoint))
        swept = _json([*smoke(sweep), "--json"])["context_sweep"]  # its human form in the docs
        run_line(smoke(tape))
    platform = current_platform()
    assert (payload["platform"], payload["simulated"]) == (platform.name, False)
    assert asked.get("device") == platform.device
    for measured in (payload, from_checkpoint):
        _assert_measured(measured)
        assert measured["capture"]["held_bytes"] > 0
        generation = measured["generation"]
        assert generation["tokens_per_s"]["transformers"] > 0
        device = platform.device.type
        assert generation["devices"] == {"engine": device, "transformers": device}
        assert generation["same_tokens_as_uncached_forward"] is True
    assert set(swept["decode"]["median_us"]) == {"eager", "piecewise", "full"}
    assert swept["prefill"]["tokens"] == 64 and swept["in_flight"]["requests"] == 12
    assert swept["kv_bytes"]["per_layer_type"]


def _json(argv: list[str]) -> dict:
    code, out = dsv4(argv[1:])
    assert code == 0, argv
    return dict(json.loads(out))


def test_human_output_names_the_simulated_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--platform", "rocm", "--simulate", *FAST]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "platform rocm (simulated on the CPU), device cpu"
    assert "MiB held by captures" in text
    assert "None" not in text


def test_unknown_held_bytes_render_as_n_a() -> None:
    payload = {
        "platform": "cuda",
        "simulated": False,
        "device": "cuda",
        "configurations": {},
        "decode": [],
        "capture": {
            "seconds_per_graph": [["FULL", 1, 0.01]],
            "total_s": 0.01,
            "held_bytes": None,
            "eager_step_peak_bytes": 3 * 2**20,
            "held/eager_step_peak": None,
        },
        "generation": {
            "prompts": 4,
            "tokens_per_s": {"engine": 100.0},
            "run_capture": {"graphs": 1, "total_s": 0.01},
        },
        "limit": {"machine": [], "steps": [], "rows": [], "method": "m"},
        "tensor_parallel_size": 2,
        "collective_share_of_decode": 0.125,
        "method": "m",
    }
    text = render(payload)
    assert "tensor parallel size 2: rank 0 spent 12.5% of the decode timing in collectives" in text
    assert text.splitlines()[0] == "platform cuda, device cuda"
    assert (
        "capture: 1 graphs (every size and bucket, as dsv4 serve captures) in 0.01s, n/a held by"
        in text
    )
    assert "(n/a the 3.0 MiB peak" in text
    assert "dsv4 run of these 4 prompts captures 1 graphs (what their steps can reach)" in text
    assert "None" not in text


@pytest.mark.cuda
def test_vs_transformers_on_cuda_runs_both_on_the_gpu() -> None:
    argv = ["bench", "--platform", "cuda", *FAST, "--vs-transformers", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "runners.cli.main", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    generation = json.loads(result.stdout)["generation"]
    assert generation["devices"] == {"engine": "cuda", "transformers": "cuda"}


def test_timed_returns_the_result_and_host_seconds_on_the_cpu() -> None:
    result, seconds = timed(lambda: torch.ones(4).sum(), torch.device("cpu"))
    assert float(result) == 4.0 and seconds >= 0


@pytest.mark.cuda
def test_timed_waits_for_the_kernels_it_queued_on_cuda() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    result, seconds = timed(lambda: [a @ a for _ in range(20)][-1], torch.device("cuda"))
    assert result.is_cuda and seconds > 0
    assert torch.cuda.current_stream().query(), "nothing is left running after timed returns"


@pytest.mark.cuda
def test_cuda_bench_reports_the_platform_and_positive_latencies() -> None:
    argv = ["bench", "--platform", "cuda", "--batch-sizes", "1", "--threads", "1"]
    argv += ["--repeats", "3", "--rounds", "1", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "runners.cli.main", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (payload["platform"], payload["simulated"], payload["device"]) == ("cuda", False, "cuda")
    _assert_measured(payload)


def test_bench_labels_each_configuration_by_what_it_resolved_to() -> None:
    """A platform that needs the wide region cannot run FULL graphs: the column named 'full'
    then runs PIECEWISE decode graphs, and the benchmark says so with the reason."""
    from typing import Any

    from graphs import WideRegion
    from graphs.backend import GraphBackend
    from platforms import Platform
    from platforms.cpu import tape_backend, tape_memory_pool
    from runners.measure.suite import _configurations
    from runners.spec import EngineSpec

    class WideOnly(Platform):
        name = "wideonly"
        device_type = "cpu"
        eager_region_strategy = WideRegion()
        v2_excluded_architectures = frozenset()

        def is_available(self) -> bool:
            return True

        def create_memory_pool(self) -> Any:
            return tape_memory_pool()

        def create_graph_backend(self, pool: Any) -> GraphBackend:
            return tape_backend(pool)

    configurations = _configurations(EngineSpec(platform=WideOnly()))
    full = configurations["full"]
    assert (full["decode"], full["eager_region"]) == ("PIECEWISE", "wide")
    assert any("FULL downgraded to PIECEWISE" in r for r in full["downgrades"])
    assert configurations["eager"]["downgrades"] == []
    assert "narrower than the wide region" in configurations["narrow"]["refused"]
