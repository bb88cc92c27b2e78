"""``--tensor-parallel-size`` and ``torchrun`` from outside: the same greedy tokens as one rank
in every graph mode, on the built-in model and on a checkpoint transformers wrote; a size the
model cannot split is refused before any process starts; a rank killed mid-generation, or a
Ctrl-C, stops every rank within seconds and leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
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
from tests.processes import children
from tests.readme.examples import command_lines, shell_block
from tests.runners.support import resolve_on

PROMPTS = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "9,8,7", "--max-new-tokens", "5"]
FAST = ["--platform", "cpu", "--capture-sizes", "1,2", "--threads", "1"]
DSV4 = [sys.executable, "-m", "dsv4_cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _outputs(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[int]]:
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    return [o["output_ids"] for o in payload["outputs"]]


MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def _resolved_at_two_ranks(mode: str) -> tuple[object, ...]:
    r = resolve_on(runner="v2", mode=mode, tensor_parallel_size=2)
    return (r.decode_mode, r.mixed_mode, r.eager_region.name)


DISTINCT = sorted({_resolved_at_two_ranks(m): m for m in MODES}.values(), key=MODES.index)
"""One mode per distinct resolution at two ranks on the CPU: there FULL graphs are downgraded
to PIECEWISE (gloo collectives break them), so FULL and FULL_AND_PIECEWISE run what PIECEWISE
runs (``test_parallel_resolution`` checks the downgrade itself)."""


def test_the_modes_resolve_to_three_runs_at_two_ranks() -> None:
    assert DISTINCT == ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.parametrize("mode", DISTINCT[:-1])  # the default, FULL_AND_PIECEWISE: the docs' test
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
    for mode in DISTINCT:
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
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr  # (torchrun's own report names the failed rank)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    return [o["output_ids"] for o in json.loads(lines[0])["outputs"]]


def _torchrun(argv: list[str], **names: str) -> list[str]:
    """A documented ``torchrun`` line as this interpreter runs it: ``HOST``, ``PORT`` and ``R``
    filled in from ``names``, a free port where the line leaves torchrun's default."""
    filled = [names.get(arg, arg) for arg in argv[1:]]
    if "--master-port" not in filled:
        filled = ["--master-port", str(_free_port()), *filled]
    return [*TORCHRUN, *filled]


@pytest.mark.slow
def test_the_documented_parallel_commands_give_the_tokens_of_one_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every line of the docs' tensor-parallel block, with this suite's prompts and sizes
    appended: local ranks, torchrun on one node and on two (both here), and explain."""
    extra = [*PROMPTS, *FAST, "--json"]
    lines = command_lines(shell_block("tensor-parallel"))
    assert [line[0] for line in lines] == ["dsv4", "torchrun", "torchrun", "dsv4"]
    local, one_node, two_nodes, explain = lines
    run_argv = one_node[one_node.index("dsv4_cli") + 1 :]
    assert run_argv[0] == "run" and local[1:] == [*run_argv, "--tensor-parallel-size", "2"]
    expected = _outputs(capsys, [*run_argv, *extra[:-1]])
    assert _outputs(capsys, [*local[1:], *extra[:-1]]) == expected
    assert _run_json([*_torchrun(one_node), *extra]) == expected
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [*_torchrun(two_nodes, HOST="127.0.0.1", PORT=port, R=str(rank)), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # each node's agent and rank form one group to kill
        )
        for rank in (0, 1)
    ]
    outs = _communicate_all(nodes, timeout=240)
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    assert outs[1][0].strip() == ""  # the second node's rank is 1: it prints nothing
    assert [o["output_ids"] for o in json.loads(outs[0][0])["outputs"]] == expected
    assert main([*explain[1:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_parallel_size"] == 2


def _communicate_all(
    processes: list[subprocess.Popen[str]], *, timeout: float
) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr), all read at once (none can block writing to a pipe
    another's wait leaves unread); past ``timeout``, the process group of each (started with
    ``start_new_session``: its children hold the pipes too) is killed and the test fails with
    what each wrote."""
    with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
        reads = [pool.submit(process.communicate) for process in processes]
        done, _ = concurrent.futures.wait(reads, timeout=timeout)
        if len(done) < len(processes):
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            written = [read.result() for read in reads]
            pytest.fail(f"not done after {timeout} s; each wrote (stdout, stderr): {written}")
    return [read.result() for read in reads]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _started(parent: subprocess.Popen[str], count: int) -> list[int]:
    """The pids of ``parent``'s ``count`` ranks, as soon as they exist: the children of the fork
    server it started (``runners.distributed.rank_context``)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        servers = [pid for pid in children(parent.pid) if b"forkserver" in _cmdline(pid)]
        ranks = [pid for server in servers for pid in children(server)]
        if len(ranks) == count:
            return sorted(ranks)
        time.sleep(0.02)
    raise AssertionError("the ranks did not start")


def _sigint_in(pid: int, mask: str) -> bool:
    """Whether SIGINT is in ``pid``'s signal ``mask`` of /proc (``SigCgt``: it has a handler,
    so a Python interpreter has started there; ``SigBlk``: it is blocked)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{mask}:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def _in_process_group(pids: list[int]) -> bool:
    """Whether every rank holds a socket: they open them joining the process group, after the
    library is imported (before, a spawned rank has pipes only)."""
    for pid in pids:
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:  # closed since the listing
                continue
        if not any(link.startswith("socket:") for link in links):
            return False
    return True


def _ranks(parent: subprocess.Popen[str], count: int) -> list[int]:
    """The pids of ``parent``'s spawned ranks, once they all run the model."""
    ranks = _started(parent, count)
    deadline = time.monotonic() + 60
    while not _in_process_group(ranks):
        assert time.monotonic() < deadline, "the ranks did not join their process group"
        time.sleep(0.05)
    time.sleep(2)  # the tiny model builds in well under that: they are generating
    return ranks


def _gone(pids: list[int]) -> bool:
    """Whether every process of ``pids`` has exited (a zombie an adopter has not reaped yet
    has exited too)."""
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            return False
    return True


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


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_terminal_ctrl_c_while_ranks_start_is_one_line() -> None:
    """A terminal sends Ctrl-C to the whole foreground group, ranks importing torch included:
    the parent alone answers it, with one line."""
    parent = subprocess.Popen(
        LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    ranks = _started(parent, 2)
    deadline = time.monotonic() + 60
    while not all(_sigint_in(pid, "SigCgt") for pid in ranks):  # Python runs: importing
        assert time.monotonic() < deadline, "the ranks did not start Python"
        time.sleep(0.01)
    # held back in the ranks (a traceback each otherwise, when they print before the parent
    # stops them: a race, so the mask itself is checked)
    assert all(_sigint_in(pid, "SigBlk") for pid in ranks)
    os.killpg(parent.pid, signal.SIGINT)
    out, err = parent.communicate(timeout=60)
    assert (parent.returncode, out, err) == (130, "", "dsv4 run: interrupted\n")
    assert _gone(ranks)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("when", ["starting", "in the process group"])
def test_ranks_whose_parent_is_killed_exit_within_seconds(when: str) -> None:
    parent = subprocess.Popen(LONG_RUN, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _started(parent, 2)
    deadline = time.monotonic() + 60
    while when != "starting" and not _in_process_group(ranks):
        assert time.monotonic() < deadline, "the ranks did not join their process group"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    while not _gone(ranks) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    assert _gone(ranks) and time.monotonic() - killed < 3.0
