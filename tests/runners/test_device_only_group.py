"""A simulated CUDA or ROCm parallel run refuses what NCCL refuses: a collective on a tensor a
real run would hold on the host fails on the CPU with NCCL's error ("No backend type associated
with device type cpu"), one on a device tensor runs as gloo would; and the parallel paths
(``--tensor-parallel-size``, ``launch_engine``) of a simulated NCCL platform run end to end.

Which tensors a real run would hold on the host is ``platforms.host_tensors.HostTensors``'s
business; its rules are checked here in-process, the group in two local ranks."""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

from platforms import CpuPlatform, CudaPlatform, RocmPlatform, simulate
from platforms.device_only_group import DEVICE_ONLY_GLOO, serves_host_tensors
from platforms.host_tensors import HostTensors, device_work
from runners import EngineSpec, SamplingParams, build_engine
from runners.cli.main import main
from runners.distributed import process_group_backend, run_local
from runners.ranked import launch_engine

NCCL_ERROR = "No backend type associated with device type cpu"
DEVICE = torch.device("cpu")
"""The simulated platform's device: named, it stands for the GPU."""


def test_simulated_nccl_platforms_run_their_ranks_on_the_device_only_group() -> None:
    assert not serves_host_tensors("nccl") and serves_host_tensors("gloo")
    assert process_group_backend(simulate(CudaPlatform())) == DEVICE_ONLY_GLOO
    assert process_group_backend(simulate(RocmPlatform())) == DEVICE_ONLY_GLOO
    assert process_group_backend(CpuPlatform()) == "gloo"
    assert process_group_backend(simulate(CpuPlatform())) == "gloo"


def test_host_tensors_follow_where_a_gpu_run_would_make_each_tensor() -> None:
    host = HostTensors()
    with host:
        literal = torch.tensor([1, 2])
        on_device = torch.tensor([1, 2], device=DEVICE)
        derived = (torch.zeros(3) + 1)[1:]
        mixed = torch.ones(3, device=DEVICE) * torch.tensor(2.0)  # a 0-dim host operand
        moved = torch.tensor([3]).to(DEVICE)
        cast = literal.to(torch.float32)
        with device_work():
            in_a_step = torch.tensor([4])
    assert host.is_host(literal) and host.is_host(derived) and host.is_host(cast)
    assert not host.is_host(on_device) and not host.is_host(mixed) and not host.is_host(moved)
    assert not host.is_host(in_a_step)
    assert "test_device_only_group.py" in (host.site_of(literal) or "")


def _collectives(args: argparse.Namespace) -> dict[str, Any]:
    """One rank: each collective on a host and a device tensor; what each gave or raised."""
    outcome: dict[str, Any] = {}

    def attempt(name: str, run: Any) -> None:
        try:
            outcome[name] = run()
        except RuntimeError as exc:
            outcome[name] = str(exc)

    rank = float(dist.get_rank() + 1)

    def all_reduce(tensor: torch.Tensor) -> list[float]:
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(tensor: torch.Tensor) -> list[float]:
        out = torch.empty(2, 1, device=DEVICE)
        dist.all_gather_into_tensor(out, tensor)
        return out.flatten().tolist()

    attempt("host all_reduce", lambda: all_reduce(torch.tensor([rank])))
    attempt("derived all_reduce", lambda: all_reduce(torch.ones(1) * rank))
    attempt("device all_reduce", lambda: all_reduce(torch.tensor([rank], device=DEVICE)))
    attempt("host broadcast", lambda: dist.broadcast(torch.tensor([rank]), src=0))
    attempt("host gather", lambda: gather(torch.tensor([[rank]])))
    attempt("device gather", lambda: gather(torch.tensor([[rank]], device=DEVICE)))
    return outcome


def test_the_device_only_group_refuses_host_tensors_as_nccl_does() -> None:
    outcome = run_local(_collectives, argparse.Namespace(), 2, DEVICE_ONLY_GLOO)
    for refused in ("host all_reduce", "derived all_reduce", "host broadcast", "host gather"):
        assert outcome[refused].startswith(NCCL_ERROR), refused
        assert "test_device_only_group.py" in outcome[refused]
    assert outcome["device all_reduce"] == [3.0]
    assert outcome["device gather"] == [1.0, 2.0]


PROMPTS = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "9,8,7", "--max-new-tokens", "4"]
FAST = ["--simulate", "--capture-sizes", "1,2", "--threads", "1"]


def test_a_simulated_nccl_platform_runs_on_two_ranks_from_the_cli(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", *PROMPTS, *FAST, "--platform", "cuda", "--json"]
    assert main([*argv, "--cudagraph-mode", "NONE"]) == 0  # one rank, eagerly: the reference
    alone = json.loads(capsys.readouterr().out)["outputs"]
    code = main([*argv, "--tensor-parallel-size", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["outputs"] == alone


def test_a_simulated_nccl_platform_runs_on_two_ranks_from_launch_engine() -> None:
    spec = EngineSpec(platform=simulate(RocmPlatform()), capture_sizes=(1, 2))
    params = SamplingParams(max_tokens=4)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    alone = [o.output_ids for o in build_engine(spec).llm.generate(prompts, params)]
    with launch_engine(attrs.evolve(spec, tensor_parallel_size=2)) as engine:
        engine.ranks.capture()
        assert [o.output_ids for o in engine.llm.generate(prompts, params)] == alone


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one with a single CUDA GPU, as far as the checks before any rank go; a
    rank started anyway fails the test."""
    monkeypatch.setattr(CudaPlatform, "is_available", lambda self: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("runners.distributed.run_local", _no_rank)
    monkeypatch.setattr("runners.ranked.RankedExecutor", _no_rank)


def _no_rank(*args: object, **kwargs: object) -> Any:
    raise AssertionError("a rank was started")


@pytest.mark.usefixtures("one_gpu")
def test_more_ranks_than_gpus_is_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", *PROMPTS, "--platform", "cuda", "--tensor-parallel-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "dsv4 run: error: tensor-parallel size 2 needs 2 cuda devices, one per local rank, and "
        "platform cuda has 1 on this machine; use at most 1 (or torchrun across machines)\n"
    )
    with pytest.raises(ValueError, match="needs 2 cuda devices"):
        launch_engine(EngineSpec(platform="cuda", tensor_parallel_size=2))
