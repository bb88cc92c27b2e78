"""Local ranks (``runners.distributed.run_local``): rank 0's payload comes back once every rank
finished; a rank that raises or dies stops every rank within seconds, with one line naming it,
and no worker process outlives the call."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dsv4.parallel import TensorParallel
from runners.distributed import (
    GroupOutlivedError,
    RankFailedError,
    local_worlds,
    process_group,
    run_local,
)


def _sum_of_ranks(args: argparse.Namespace) -> dict[str, Any]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return {"sum": value.item(), "rank": dist.get_rank(), "seed": torch.initial_seed()}


def _rank_fails(args: argparse.Namespace) -> dict[str, Any]:
    if dist.get_rank() == args.bad_rank:
        if args.how == "raise":
            raise ValueError("boom\nsecond line")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the others wait for the failed rank: they must be stopped, not hang
    time.sleep(120)
    return {}


def _no_workers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("dsv4-rank")]


def test_rank_zero_payload_after_a_collective() -> None:
    payload = run_local(_sum_of_ranks, argparse.Namespace(), 3, "gloo")
    assert payload["sum"] == 1 + 2 + 3 and payload["rank"] == 0
    assert _no_workers_left()


@pytest.mark.parametrize(
    ("how", "message"),
    [("raise", "rank 1 failed: ValueError: boom second line"), ("die", "rank 1 died")],
)
def test_a_failing_rank_stops_every_rank_with_one_line(how: str, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failed:
        run_local(_rank_fails, argparse.Namespace(bad_rank=1, how=how), 2, "gloo")
    assert time.monotonic() - start < 60
    assert str(failed.value).startswith(message) and "\n" not in str(failed.value)
    if how == "die":
        assert str(failed.value) == "rank 1 died (killed by signal 9)"
    assert _no_workers_left()


def _sleeps(args: argparse.Namespace) -> dict[str, Any]:
    time.sleep(120)
    return {}


def test_a_ctrl_c_while_the_ranks_start_stops_the_ranks_already_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C that arrives while the ranks start is held until the last one has started, then
    raised in the parent: every rank is stopped before it propagates (left running, they would
    hold the parent at exit, which joins its children)."""
    import runners.distributed as distributed

    held_back = distributed.children_ignore_ctrl_c

    @contextlib.contextmanager
    def ctrl_c_arrives_inside() -> Iterator[None]:
        with held_back():
            os.kill(os.getpid(), signal.SIGINT)  # pending: blocked until the block ends
            yield

    monkeypatch.setattr(distributed, "children_ignore_ctrl_c", ctrl_c_arrives_inside)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_local(_sleeps, argparse.Namespace(), 2, "gloo")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _no_workers_left() and time.monotonic() - start < 30


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_leaving_the_group_joins_its_threads_while_the_model_keeps_its_parallel_layout() -> None:
    """The model keeps its ``TensorParallel`` past the group; were that to hold the group, the
    group's worker threads would outlive ``destroy_process_group`` into the interpreter's exit,
    where one releasing a finished collective's tensors needs the GIL and aborts the process
    ('terminate called without an active exception', seen under torchrun)."""
    before = _threads()
    with process_group(local_worlds(1)[0], "gloo"):
        parallel = TensorParallel.from_default_group()
        assert parallel.all_reduce_(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]
        assert _threads() > before  # the group's own threads
    assert _threads() == before
    assert parallel.size == 1


_IMPORTS_INSIDE_THE_GROUP = """
import os, sys, torch.distributed as dist
assert "torch.distributed.nn.functional" not in sys.modules
from runners.distributed import local_worlds, process_group
before = len(os.listdir("/proc/self/task"))
with process_group(local_worlds(1)[0], "gloo"):
    import torch.distributed.nn.functional  # what building a model on the meta device does
    dist.barrier()
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_module_that_binds_the_group_at_import_cannot_hold_it_past_leaving() -> None:
    """In a fresh interpreter (where nothing imported it yet) the body imports
    ``torch.distributed.nn.functional``, whose collectives bind the default group at import:
    leaving still frees the group and joins its threads, and the process exits cleanly."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_INSIDE_THE_GROUP],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_body_that_keeps_the_group_fails_loudly_on_leaving() -> None:
    """Anything else that holds the default group past ``destroy_process_group`` is an error
    raised on leaving (not an abort at the interpreter's exit, now and then)."""
    kept: list[object] = []
    with (
        pytest.raises(GroupOutlivedError, match="still referenced"),
        process_group(local_worlds(1)[0], "gloo"),
    ):
        kept.append(dist.group.WORLD)
    kept.clear()
