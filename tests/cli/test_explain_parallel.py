"""``dsv4 explain --tensor-parallel-size N``: the collectives' policy on any machine (DESIGN §9).

``--platform cpu`` downgrades FULL decode graphs (gloo collectives break on the tape),
``--platform cuda`` and ``rocm`` keep what they would pick alone (NCCL/RCCL collectives are
captured), and ``--simulate`` keeps the real policy while the run breaks around collectives.
"""

from __future__ import annotations

import json

import pytest

from runners.cli.main import main

CPU_TEXT = """\
architecture   DeepseekV4ForCausalLM
platform       cpu
parallel       tensor 2, gloo collectives as eager breaks
runner         v2
graph mode     decode PIECEWISE, mixed PIECEWISE
eager region   narrow (required: narrow)
requirements   platform full-graph, runner full-graph
reasons:
  1. platform cpu: given
  2. runner v2: DeepseekV4ForCausalLM is in the ModelRunnerV2 default set
  3. tensor parallel size 2: each collective is an eager break (platform cpu cannot capture \
gloo collectives into a graph: gloo communicates from its own host threads, outside the ops the \
tape records)
  4. cudagraph mode FULL_AND_PIECEWISE: the default
  5. decode batches: FULL downgraded to PIECEWISE: platform cpu cannot capture collectives at \
tensor parallel size 2, and a full graph has no eager break
  6. eager region narrow required by mode PIECEWISE (widest of platform cpu full-graph, runner \
v2 full-graph, mode PIECEWISE narrow): PIECEWISE capture runs at least the attention core \
eagerly between graph pieces
"""

CUDA_COLLECTIVES = (
    "tensor parallel size 2: collectives are captured inside the graphs (platform cuda can "
    "capture nccl collectives into a graph: NCCL kernels run on the capturing stream and are "
    "recorded into CUDA graphs like any other kernel)"
)


def _text(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["explain", *argv]) == 0
    return capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    out = _text(capsys, [*argv, "--json"])
    assert out.count("\n") == 1
    return json.loads(out)


def test_cpu_at_two_ranks_shows_the_full_downgrade_and_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _text(capsys, ["--platform", "cpu", "--tensor-parallel-size", "2"]) == CPU_TEXT


def test_cuda_at_two_ranks_keeps_full_decode(capsys: pytest.CaptureFixture[str]) -> None:
    text = _text(capsys, ["--platform", "cuda", "--tensor-parallel-size", "2"])
    lines = text.splitlines()
    assert lines[2] == "parallel       tensor 2, nccl collectives captured in the graphs"
    assert lines[4] == "graph mode     decode FULL, mixed PIECEWISE"
    assert f"  3. {CUDA_COLLECTIVES}" in lines
    assert "downgraded" not in text


def test_rocm_at_two_ranks_keeps_its_single_process_modes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    alone = _json(capsys, ["--platform", "rocm"])
    parallel = _json(capsys, ["--platform", "rocm", "--tensor-parallel-size", "2"])
    assert parallel["cudagraph_mode"] == alone["cudagraph_mode"]
    assert (parallel["distributed_backend"], parallel["collectives_in_graph"]) == ("nccl", True)
    assert [r for r in parallel["reasons"] if "tensor parallel" not in r] == alone["reasons"]


def test_simulated_cuda_keeps_the_policy_and_breaks_on_the_tape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--platform", "cuda", "--simulate", "--tensor-parallel-size", "2"]
    payload = _json(capsys, argv)
    assert payload["simulated"] is True
    assert payload["cudagraph_mode"] == {"decode": "PIECEWISE", "mixed": "PIECEWISE"}
    assert (payload["tensor_parallel_size"], payload["distributed_backend"]) == (2, "gloo")
    assert payload["collectives_in_graph"] is False
    assert payload["reasons"][2] == (
        "tensor parallel size 2: collectives are captured inside the graphs on the device "
        "(platform cuda can capture nccl collectives into a graph: NCCL kernels run on the "
        "capturing stream and are recorded into CUDA graphs like any other kernel); simulated on "
        "the CPU tape, the run breaks around each one instead"
    )
    lines = _text(capsys, argv).splitlines()
    assert lines[1:3] == [
        "platform       cuda (simulated)",
        "parallel       tensor 2, gloo collectives as eager breaks",
    ]


def test_simulated_cpu_downgrades_as_the_cpu_does(capsys: pytest.CaptureFixture[str]) -> None:
    text = _text(capsys, ["--platform", "cpu", "--simulate", "--tensor-parallel-size", "2"])
    assert text == CPU_TEXT.replace(
        "platform       cpu\n", "platform       cpu (simulated)\n"
    ).replace("1. platform cpu: given", "1. platform cpu: simulated on the CPU")


def test_one_rank_explains_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    default = _text(capsys, ["--platform", "cpu"])
    assert _text(capsys, ["--platform", "cpu", "--tensor-parallel-size", "1"]) == default
    assert "parallel" not in default and "collective" not in default
    payload = _json(capsys, ["--platform", "cpu"])
    assert payload["tensor_parallel_size"] == 1
    assert payload["cudagraph_mode"] == {"decode": "FULL", "mixed": "PIECEWISE"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "must be >= 1, got 0"),
        ("-2", "must be >= 1, got -2"),
        ("two", "expected an integer, got 'two'"),
    ],
)
def test_a_bad_size_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    assert main(["explain", "--platform", "cpu", "--tensor-parallel-size", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"dsv4 explain: error: argument --tensor-parallel-size: {message} "
        "(see 'dsv4 explain --help')\n"
    )
