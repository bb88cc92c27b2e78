"""Running a function on N local ranks (gloo on 127.0.0.1, spawned processes) for the
tensor-parallel tests, without ever hanging.

``run_ranks(worker, size, argument, timeout=...)`` starts ``size`` processes; each initialises
the default process group, calls ``worker(TensorParallel.from_default_group(), argument)`` and
sends back its (picklable, small) result or its traceback. The first failure, a rank that dies
without answering, or the deadline stops every rank (terminated, then killed) and raises; the
processes are always joined before it returns.
"""

from __future__ import annotations

import datetime
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4.parallel import TensorParallel

__all__ = ["run_ranks"]

R = TypeVar("R")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(
    worker: Callable[[TensorParallel, Any], Any],
    rank: int,
    size: int,
    port: int,
    argument: Any,
    results: Any,
    timeout: float,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        results.put((rank, True, worker(TensorParallel.from_default_group(), argument)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    worker: Callable[[TensorParallel, Any], R], size: int, argument: Any, *, timeout: float
) -> list[R]:
    """``worker``'s result on each of ``size`` ranks, in rank order (see the module)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(worker, rank, size, port, argument, results, timeout),
            daemon=True,
        )
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    found: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(found) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(size)) - set(found))
                raise TimeoutError(f"ranks {missing} of {size} did not answer within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(processes)
                    if r not in found and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise RuntimeError(f"ranks {dead} of {size} died without answering") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {size} failed:\n{value}")
            found[rank] = value
    finally:
        for process in processes:
            process.join(timeout=10 if len(found) == size else 0.1)
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [found[rank] for rank in range(size)]
