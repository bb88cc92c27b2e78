"""``--tensor-parallel-size`` and ``torchrun`` from outside: the same greedy tokens as one rank
in every graph mode, on the built-in model and on a checkpoint transformers wrote; a size the
model cannot split is refused before any process starts; a rank killed mid-generation, or a
Ctrl-C, stops every rank within seconds and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4 import DeepseekV4Config
from dsv4.testing import random_model
from runners.cli.main import main
from tests.dsv4.support import hf_twin

PROMPTS = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "9,8,7", "--max-new-tokens", "5"]
FAST = ["--platform", "cpu", "--capture-sizes", "1,2", "--threads", "1"]
DSV4 = [sys.executable, "-m", "dsv4_cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _outputs(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[int]]:
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    return [o["output_ids"] for o in payload["outputs"]]


MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_give_the_tokens_of_one_in_every_graph_mode(
    capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    argv = ["run", *PROMPTS, *FAST, "--cudagraph-mode", mode]
    assert _outputs(capsys, [*argv, "--tensor-parallel-size", "2"]) == _outputs(capsys, argv)


@pytest.fixture(scope="module")
def transformers_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf")
    hf_twin(random_model(DeepseekV4Config.tiny(), 4)).save_pretrained(directory)
    return directory


def test_a_transformers_checkpoint_on_two_ranks_in_every_graph_mode(
    capsys: pytest.CaptureFixture[str], transformers_checkpoint: Path
) -> None:
    argv = ["run", *PROMPTS, *FAST, "--checkpoint", str(transformers_checkpoint)]
    expected = _outputs(capsys, argv)
    for mode in MODES:
        parallel = [*argv, "--cudagraph-mode", mode, "--tensor-parallel-size", "2"]
        assert _outputs(capsys, parallel) == expected, mode


def test_matrix_on_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["matrix", "--platform", "cpu", "--capture-sizes", "1,2", "--max-new-tokens", "3"]
    assert main([*argv, "--tensor-parallel-size", "2", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["cells"]
    assert {c["status"] for c in cells} == {"equal", "refused"}
    assert all(c["resolved"]["decode"] != "FULL" for c in cells if c["resolved"])


def test_a_size_the_model_cannot_split_is_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", *PROMPTS, *FAST, "--tensor-parallel-size", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "dsv4 run: error: tensor-parallel size 4 does not divide o_groups (2); use a size that "
        "divides num_attention_heads, o_groups, n_routed_experts, moe_intermediate_size, "
        "vocab_size\n"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_json(command: list[str]) -> list[list[int]]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    return [o["output_ids"] for o in json.loads(lines[0])["outputs"]]


def test_torchrun_one_node_and_two_nodes_give_the_tokens_of_one_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", *PROMPTS, *FAST, "--json"]
    expected = _outputs(capsys, argv[:-1])
    one_node = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(_free_port())]
    assert _run_json([*one_node, "-m", "dsv4_cli", *argv]) == expected
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "-m",
                "dsv4_cli",
                *argv,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    assert outs[1][0].strip() == ""  # the second node's rank is 1: it prints nothing
    assert [o["output_ids"] for o in json.loads(outs[0][0])["outputs"]] == expected


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _ranks(parent: subprocess.Popen[str], count: int) -> list[int]:
    """The pids of ``parent``'s spawned ranks, once they all run the model."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = [
            pid
            for pid in _children(parent.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        if len(ranks) == count:
            time.sleep(8)  # let them get into the generation
            return sorted(ranks)
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


def _gone(pids: list[int]) -> bool:
    return not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


LONG_RUN = [
    *DSV4,
    "run",
    "--prompt-ids",
    "1,2,3",
    "--max-new-tokens",
    "900",
    "--ignore-eos",
    *FAST,
    "--cudagraph-mode",
    "NONE",
    "--tensor-parallel-size",
    "2",
]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("fault", "code", "line"),
    [
        ("kill rank 1", 1, "dsv4 run: error: rank 1 died (killed by signal 9)"),
        ("Ctrl-C", 130, "dsv4 run: interrupted"),
    ],
)
def test_a_fault_stops_every_rank_and_leaves_no_process(fault: str, code: int, line: str) -> None:
    parent = subprocess.Popen(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = _ranks(parent, 2)
    start = time.monotonic()
    if fault == "Ctrl-C":
        os.kill(parent.pid, signal.SIGINT)
    else:
        os.kill(ranks[1], signal.SIGKILL)
    out, err = parent.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert parent.returncode == code and out == ""
    assert err.strip().splitlines()[-1] == line, err
    assert _gone(ranks)
