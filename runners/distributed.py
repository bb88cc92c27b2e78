"""Running one CLI command as N ranks of a ``torch.distributed`` process group.

Every rank runs the same command on the same arguments (SPMD): each builds its share of the
model and an identical engine, and since the model's logits are gathered to every rank and
every rank's sampling generator starts from one shared seed, the engines schedule and sample
identically; rank 0 alone prints. Two ways to start the ranks:

- ``--tensor-parallel-size N`` (``run_local``): this process spawns N local worker processes,
  which meet at a free local port, and supervises them.
- ``torchrun`` (``torchrun_world``): this process is one rank of a world ``torchrun`` started,
  on any number of nodes, at its rendezvous (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` in the environment).

Invariants of ``run_local``:
- It returns rank 0's payload only once every rank has finished cleanly.
- If a rank raises, its error reaches the parent as one line, and a rank that dies (a signal,
  ``os._exit``) is seen by its exit code; either way every other rank is terminated (killed
  after ``GRACE_S``), and the parent raises ``RankFailedError`` naming the rank and its error:
  the cause, not the peers that failed because they lost it (``_cause``).
- A ``KeyboardInterrupt`` in the parent terminates every rank the same way and is re-raised;
  the ranks never see a terminal's Ctrl-C themselves (``dsv4_rank``), so it prints one line.
- A rank whose parent is killed exits at once (``dsv4_rank.run_rank`` watches it).
- No worker outlives the call: each is joined, or killed and joined.
- Collectives give up after ``COLLECTIVE_TIMEOUT`` (the process group's timeout), so a rank
  whose peer vanished unnoticed cannot wait forever.

Invariant of ``process_group``: the group it joins is freed when the block ends, so its worker
threads are joined there, not left to the interpreter's exit (``BINDS_THE_GROUP_AT_IMPORT``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from dsv4_rank import children_ignore_ctrl_c, run_rank
from platforms import Platform, SimulatedPlatform
from platforms.device_only_group import (
    DEVICE_ONLY_GLOO,
    register_device_only_backend,
    serves_host_tensors,
)
from platforms.host_tensors import HostTensors
from runners.errors import DeviceCountError

__all__ = [
    "BINDS_THE_GROUP_AT_IMPORT",
    "COLLECTIVE_TIMEOUT",
    "GRACE_S",
    "GroupOutlivedError",
    "RankFailedError",
    "World",
    "cause_of",
    "check_local_devices",
    "execute_ranked",
    "exit_reason",
    "local_worlds",
    "on_the_cpu",
    "one_line",
    "process_group",
    "process_group_backend",
    "rank_device",
    "run_local",
    "share_threads",
    "silence",
    "torchrun_world",
]

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
GRACE_S = 5.0
"""Seconds a terminated rank gets to exit before it is killed."""
SETTLE_S = 3.0
"""Seconds to wait, after a rank fails, for the other ranks' reports (to name the cause)."""

Command = Callable[[argparse.Namespace], dict[str, Any]]


class RankFailedError(RuntimeError):
    """A rank of a parallel run raised or died; the message names the rank and its error."""


@attrs.frozen
class World:
    """This process's place in a process group."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    local_rank: int = attrs.field(default=attrs.Factory(lambda world: world.rank, takes_self=True))
    """This process's rank among those on its machine (its GPU under NCCL)."""


def process_group_backend(platform: Platform) -> str:
    """The process-group backend ranks running on ``platform`` use: the platform's own
    (``Platform.distributed_backend``) on its device; where it runs on the CPU (the CPU itself,
    a simulated platform, or one not available here) ``gloo`` — refusing host tensors as the
    real backend does (``DEVICE_ONLY_GLOO``) when that serves device tensors only (NCCL)."""
    if platform.device.type != "cpu" and platform.is_available():
        return platform.distributed_backend
    real = platform.platform if isinstance(platform, SimulatedPlatform) else platform
    return "gloo" if serves_host_tensors(real.distributed_backend) else DEVICE_ONLY_GLOO


def check_local_devices(platform: Platform, size: int) -> None:
    """Raise ``DeviceCountError`` when ``size`` local ranks on ``platform`` would need more
    devices than it has here (each local rank takes one); a platform whose ranks share the
    device (the CPU, a simulated one) or that is not available here is not refused."""
    count = platform.device_count()
    if count is None or size <= count or not platform.is_available():
        return
    raise DeviceCountError(
        f"tensor-parallel size {size} needs {size} {platform.device_type} devices, one per local "
        f"rank, and platform {platform.name} has {count} on this machine; use at most {count} "
        "(or torchrun across machines)"
    )


def rank_device(world: World, backend: str) -> torch.device:
    """The device a rank of ``world`` on ``backend`` holds the tensors of its collectives on:
    the GPU of its local rank under ``nccl`` (which serves nothing else), else the CPU."""
    return torch.device("cuda", world.local_rank) if backend == "nccl" else torch.device("cpu")


def on_the_cpu(backend: str) -> bool:
    """Whether ranks on ``backend`` run on the CPU (``gloo``, plain or device-only)."""
    return backend in ("gloo", DEVICE_ONLY_GLOO)


def local_worlds(size: int) -> list[World]:
    """The ``size`` ranks of a world on this machine, meeting at a free local port."""
    port = _free_port()
    return [
        World(rank=rank, size=size, master_addr="127.0.0.1", master_port=port)
        for rank in range(size)
    ]


def torchrun_world() -> World | None:
    """The world ``torchrun`` started this process in, or ``None`` outside ``torchrun``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return World(
        rank=int(os.environ["RANK"]),
        size=int(os.environ["WORLD_SIZE"]),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
    )


BINDS_THE_GROUP_AT_IMPORT = ("torch.distributed.nn.functional",)
"""torch modules that bind the default process group when they are imported: each collective of
``torch.distributed.nn.functional`` takes ``group=group.WORLD`` as a default, evaluated once, at
import. Imported lazily (building a model on the meta device imports ``torch._dynamo``, which
imports FSDP, which imports it) while a group exists, they hold that group for the life of the
process; ``destroy_process_group`` cannot free it, and its gloo worker threads meet the
interpreter's exit, where one still releasing a finished collective's tensors waits for the
GIL, is made to exit instead, and aborts the process ('terminate called without an active
exception', SIGABRT; seen under ``torchrun``, whose ranks exit through the interpreter's exit,
in about 1 of 6 two-node runs). ``process_group`` imports them before the group exists, so they
bind ``None``."""


class GroupOutlivedError(RuntimeError):
    """The default process group was still referenced after ``destroy_process_group``."""


@contextlib.contextmanager
def process_group(world: World, backend: str) -> Iterator[None]:
    """Join ``world``'s default process group on ``backend`` and share one sampling seed (rank
    0's) with every rank; leave the group on exit. Under ``nccl`` each rank first takes the GPU
    of its local rank (NCCL needs one device per rank; the platform's ``cuda`` device is then
    that one). Under ``DEVICE_ONLY_GLOO`` the body runs under the rank's ``HostTensors``, which
    the group asks where each tensor would live on the GPU.

    Leaving frees the group, which joins its worker threads there and then: the modules of
    ``BINDS_THE_GROUP_AT_IMPORT`` are imported before it exists, and a body that ran to its
    end and left something else holding the group raises ``GroupOutlivedError`` (a loud,
    deterministic failure instead of an abort at the interpreter's exit, now and then)."""
    for name in BINDS_THE_GROUP_AT_IMPORT:
        importlib.import_module(name)
    host = HostTensors()
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    elif backend == DEVICE_ONLY_GLOO:
        register_device_only_backend(host)
    with host if backend == DEVICE_ONLY_GLOO else contextlib.nullcontext():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{world.master_addr}:{world.master_port}",
            rank=world.rank,
            world_size=world.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        group = weakref.ref(dist.group.WORLD)
        finished = False
        try:
            seed = torch.tensor(
                [torch.seed() % 2**62 if world.rank == 0 else 0],
                dtype=torch.int64,
                device=rank_device(world, backend),
            )
            dist.broadcast(seed, src=0)
            torch.manual_seed(int(seed.item()))
            yield
            finished = True
        finally:
            dist.destroy_process_group()
            _check_freed(group, raising=finished)


def _check_freed(group: weakref.ref[Any], *, raising: bool) -> None:
    """After ``destroy_process_group``: free the group now if only a reference cycle holds it;
    if anything else does, raise ``GroupOutlivedError`` (when ``raising``: never over the
    body's own error)."""
    if group() is None:
        return
    gc.collect()
    if group() is not None and raising:
        raise GroupOutlivedError(
            "the default process group is still referenced after destroy_process_group, so its "
            "worker threads would outlive it into the interpreter's exit and may abort it; a "
            "module that binds the group at import belongs in BINDS_THE_GROUP_AT_IMPORT, "
            "anything else should name the default group as None"
        )


def execute_ranked(
    command: Command, args: argparse.Namespace, size: int, backend: str
) -> dict[str, Any] | None:
    """``command(args)`` as this process's part of a parallel run: under ``torchrun``, as its
    rank (the parallel size is the world's; ``None`` on every rank but 0, which alone prints);
    else on ``size`` local ranks (``run_local``), or in this process for size 1."""
    world = torchrun_world()
    if world is None:
        return command(args) if size == 1 else run_local(command, args, size, backend)
    if size not in (1, world.size):
        raise RankFailedError(
            f"--tensor-parallel-size {size} differs from the {world.size} processes torchrun "
            "started; leave it out under torchrun"
        )
    args.tensor_parallel_size = world.size
    if world.rank != 0:
        silence()
    with process_group(world, backend):
        payload = command(args)
    return payload if world.rank == 0 else None


def run_local(
    command: Command, args: argparse.Namespace, size: int, backend: str
) -> dict[str, Any]:
    """Run ``command(args)`` on ``size`` local ranks; return rank 0's payload (see the module
    docstring for what happens when a rank fails)."""
    context = rank_context()
    results: Any = context.Queue()
    workers = [
        context.Process(
            target=run_rank,
            args=(pickle.dumps((_worker, (command, args, world, backend))), results),
            name=f"dsv4-rank-{world.rank}",
        )
        for world in local_worlds(size)
    ]
    started: list[Any] = []
    try:
        # A terminal's Ctrl-C is this process's alone to handle; one that arrives while the
        # ranks start is raised as the block ends, so the ranks already started are stopped.
        with children_ignore_ctrl_c():
            for worker in workers:
                worker.start()
                started.append(worker)
        return _supervise(workers, results)
    finally:
        _stop(started)


def rank_context() -> Any:
    """How local ranks start: from a fork server where the operating system has one (Linux,
    macOS), else spawned. The server is a fresh process that imports the library once and forks
    every rank from it, so a rank starts without importing torch again, and a process that runs
    many parallel commands (a test session, the conformance kit) pays for one import; it never
    runs model code itself, so what it forks holds no threads. A rank sees the environment the
    server started with (the first parallel run's)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["runners"])
    return context


def _supervise(workers: list[Any], results: Any) -> dict[str, Any]:
    """Wait for every rank; return rank 0's payload, or raise ``RankFailedError``."""
    payloads: dict[int, Any] = {}
    failures: dict[int, str] = {}
    while len(payloads) < len(workers) and not failures:
        _collect(workers, results, payloads, failures)
    if failures:
        # A failing rank makes its peers fail too (their collectives lose it): wait briefly for
        # every rank's report, then name the cause rather than its echoes.
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(w.exitcode is None for w in workers):
            _collect(workers, results, payloads, failures)
        raise RankFailedError(cause_of(failures))
    return dict(pickle.loads(payloads[0]))


def _collect(
    workers: list[Any], results: Any, payloads: dict[int, Any], failures: dict[int, str]
) -> None:
    """Take one report (or notice a rank that exited without one) within 0.1 s."""
    try:
        rank, ok, value = results.get(timeout=0.1)
    except queue.Empty:
        for rank, worker in enumerate(workers):
            code = worker.exitcode
            if rank not in payloads and rank not in failures and code not in (None, 0):
                failures[rank] = f"rank {rank} died ({exit_reason(code)})"
        return
    if ok:
        payloads[rank] = value
    else:
        failures[rank] = f"rank {rank} failed: {value}"


_ECHOES = ("connection closed", "connection reset", "remote worker", "timed out", "timeout")
"""What a rank's error says when it only lost a peer (gloo's and NCCL's wording)."""


def cause_of(failures: dict[int, str]) -> str:
    """The failure that caused the others: a rank that died, else one whose error is not the
    echo of a lost peer, else the lowest rank's."""
    ranked = sorted(failures.items())
    for predicate in (
        lambda line: " died (" in line,
        lambda line: not any(echo in line.lower() for echo in _ECHOES),
    ):
        for _, line in ranked:
            if predicate(line):
                return line
    return ranked[0][1]


def _stop(workers: list[Any]) -> None:
    """Terminate every worker still running, kill those that outlive the grace period, and
    join them all."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    deadline = time.monotonic() + GRACE_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()


def _worker(
    command: Command, args: argparse.Namespace, world: World, backend: str, results: Any
) -> None:
    """One rank: run the command in the process group, report rank 0's payload (or any rank's
    error, as one line)."""
    if world.rank != 0:
        silence()
    if on_the_cpu(backend):
        share_threads(world.size)
    try:
        with process_group(world, backend):
            payload = command(args)
    except BaseException as exc:  # every failure reaches the parent as one line
        results.put((world.rank, False, one_line(exc)))
        return
    # Plain pickle bytes: tensors travel by value (multiprocessing would share them by a file
    # descriptor the parent could only open while this process still lives).
    results.put((world.rank, True, pickle.dumps(payload) if world.rank == 0 else None))


def share_threads(size: int) -> None:
    """Give this process, one of ``size`` local CPU ranks, its share of the machine's torch
    threads (at least one): ranks that each took every core would contend for them, and a
    collective waits for the slowest. A command's own thread setting (``--threads``) still
    overrides it."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))


def one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line (how a rank's error reaches the parent)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {message}"


def silence() -> None:
    """Rank 0 alone speaks: every other rank's output goes nowhere (its errors still reach
    the parent, or ``torchrun``, by its exit)."""
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (lives as the process)


def exit_reason(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
