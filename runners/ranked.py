"""A tensor-parallel engine driven from this process: ``launch_engine(spec)`` starts
``spec.tensor_parallel_size`` local rank processes, each holding its share of the model and
its runner, and returns a ``RankedEngine`` whose ``LLM`` lives here.

This is the Python API's way to run in parallel without ``torchrun``. The ranks form one
``torch.distributed`` process group (``gloo`` on the CPU, the platform's backend on GPUs) and
execute every step together; this process schedules and samples, and only it does, so no
sampling seed needs sharing. Each step crosses one pipe per rank: the step's chunks go to every
rank, rank 0's logits (gathered over the vocabulary, so complete) come back through shared
memory (``runners.shared_logits``).

Invariants:
- Everything ``build_engine`` refuses before allocating (``check_spec``), and more ranks than
  the platform has devices here (``check_local_devices``), is refused here before any process
  starts; an error while a rank builds its engine stops every rank and raises
  ``RankFailedError`` naming it.
- ``RankedExecutor`` is a ``StepExecutor``: ``execute`` returns rank 0's float32 logits on the
  CPU. A rank that raises or dies makes it stop every rank (killed after ``GRACE_S``) and raise
  ``RankFailedError`` naming the cause (``cause_of``); so does every later call, and the
  ``LLM`` then advances nothing (its executor contract).
- A ``KeyboardInterrupt`` here leaves the ranks running and the engine usable: the ranks run in
  their own session (a terminal's Ctrl-C reaches this process alone) and finish the step they
  are in; the next call first takes the reply it was waiting for and drops it, and the ``LLM``
  feeds that step again.
- One command is in flight at a time: calls from several threads are serialised (as ``LLM``'s).
- No rank outlives its engine: ``close`` (or leaving the ``with`` block, or the engine being
  collected, or the interpreter exiting) stops them, and a rank whose driver vanished sees its
  pipe close and exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import attrs
import torch

from dsv4_rank import ctrl_c_held
from runners.base import ModelRunner
from runners.batch import GraphKey
from runners.capacity import CapacityPlan
from runners.distributed import (
    GRACE_S,
    SETTLE_S,
    RankFailedError,
    cause_of,
    check_local_devices,
    exit_reason,
    local_worlds,
    on_the_cpu,
    one_line,
    process_group,
    process_group_backend,
    share_threads,
    silence,
)
from runners.engine import LLM, EngineLimits, ScheduledChunk
from runners.errors import PlatformNotImportableError
from runners.resolution import Resolution
from runners.shared_logits import SharedLogits
from runners.spec import EngineSpec, build_engine, check_spec, config_of, llm_of

__all__ = ["RankedEngine", "RankedExecutor", "launch_engine"]

CALLS = frozenset({"execute", "capture", "clear_graphs"})
"""Runner methods every rank runs together (they run the model, so its collectives)."""
LEAVE_S = 2.0
"""Seconds closed ranks get to leave on their own before they are terminated."""
READS = frozenset({"captured", "num_graphs", "num_eager_breaks"})
"""Runner attributes rank 0 alone is asked for (every rank holds the same)."""


@attrs.frozen
class _Ready:
    """What rank 0 reports once its engine is built."""

    limits: EngineLimits
    capacity: CapacityPlan | None
    warnings: tuple[tuple[type[Warning], str], ...]


class RankedExecutor:
    """The ``StepExecutor`` over the local rank processes of one parallel engine (see the module
    docstring); it also runs the runners' ``capture`` and asks what they captured."""

    def __init__(self, spec: EngineSpec, backend: str) -> None:
        """Start ``spec.tensor_parallel_size`` ranks on ``backend`` and wait until every one
        has built its engine (warnings rank 0 raised while building are re-raised here)."""
        self._conns: list[Connection] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._failure: str | None = None
        self._pending = 1  # rank 0 owes its report that its engine is built
        self._lock = threading.RLock()
        self._closer = weakref.finalize(self, _shut_down, self._conns, self._processes)
        try:
            for world in local_worlds(spec.tensor_parallel_size):
                conn, process = _start_rank()
                self._conns.append(conn)
                self._processes.append(process)
                conn.send_bytes(pickle.dumps((spec, world, backend)))
            ready: _Ready = self._reply()
            self.limits: EngineLimits = ready.limits
            self.capacity: CapacityPlan | None = ready.capacity
            self._logits = SharedLogits.create(ready.limits.max_rows, ready.limits.vocab_size)
            try:
                shape = (ready.limits.max_rows, ready.limits.vocab_size)
                self._request(("map", self._logits.path, shape), ranks=1)
            finally:
                self._logits.unlink()  # both have mapped it (or rank 0 is gone)
        except BaseException:
            self.close()
            raise
        for category, message in ready.warnings:
            warnings.warn(message, category, stacklevel=3)

    @property
    def pids(self) -> tuple[int, ...]:
        """The ranks' process ids, in rank order."""
        return tuple(process.pid for process in self._processes)

    @property
    def size(self) -> int:
        """Ranks the model is split over."""
        return len(self._processes)

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Run one step on every rank; rank 0's logits ``[len(chunks), vocab_size]`` (through
        shared memory: ``runners.shared_logits``)."""
        rows: int = self._request(("call", "execute", (list(chunks), token_ids)))
        return self._logits.read(rows)

    def capture(self) -> None:
        """Capture every graph the runners would (``ModelRunner.capture``), on every rank."""
        self._request(("call", "capture", ()))

    def clear_graphs(self) -> None:
        """Drop every captured graph, on every rank."""
        self._request(("call", "clear_graphs", ()))

    @property
    def captured(self) -> tuple[GraphKey, ...]:
        keys: tuple[GraphKey, ...] = self._request(("read", "captured", ()), ranks=1)
        return keys

    @property
    def num_graphs(self) -> int:
        return int(self._request(("read", "num_graphs", ()), ranks=1))

    @property
    def num_eager_breaks(self) -> int:
        return int(self._request(("read", "num_eager_breaks", ()), ranks=1))

    def check(self) -> None:
        """Raise ``RankFailedError`` naming the cause if any rank has exited or failed, even
        while no step runs (a server checks its ranks while idle)."""
        with self._lock:
            if self._failure is not None:
                raise RankFailedError(self._failure)
            if self._pending == 0 and any(p.poll() is not None for p in self._processes):
                self._reply()  # a rank is gone, so its pipe has ended: names it and raises

    def close(self) -> None:
        """Stop every rank (idempotent); later calls raise ``RankFailedError``."""
        self._failure = self._failure or "the engine is closed"
        self._closer()

    def _request(self, command: tuple[str, str, tuple[Any, ...]], ranks: int | None = None) -> Any:
        """Send ``command`` to the first ``ranks`` ranks (all by default); rank 0's reply.

        Interruptible only while waiting: a Ctrl-C never splits the sends (some ranks would
        run a step the others never see) nor loses a reply read but not yet counted; the
        replies it leaves owed (``_pending``) are taken and dropped by the next call."""
        with self._lock:  # one command and its reply at a time, whichever thread asks
            if self._failure is not None:
                raise RankFailedError(self._failure)
            while self._pending:  # the reply an interrupted call left behind
                self._reply()
            message = pickle.dumps(command)
            with ctrl_c_held():
                for conn in self._conns[:ranks]:
                    with contextlib.suppress(OSError):  # a rank that is gone: _reply names why
                        conn.send_bytes(message)
                self._pending += 1
            return self._reply()

    def _reply(self) -> Any:
        """Rank 0's next reply (one owed reply fewer); or, once any rank has failed, stop them
        all and raise."""
        failures: dict[int, str] = {}
        reply = _NOTHING
        while reply is _NOTHING and not failures:
            reply = self._next(failures, timeout=None)
        if not failures:
            return reply
        # A failing rank makes its peers fail too (their collectives lose it): wait briefly
        # for every rank's report, then name the cause rather than its echoes.
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self._processes):
            self._next(failures, timeout=0.1)
        self._failure = cause_of(failures)
        self._closer()
        raise RankFailedError(self._failure)

    def _next(self, failures: dict[int, str], timeout: float | None) -> Any:
        """Wait up to ``timeout`` for rank 0's reply or a failure: return the reply, else
        ``_NOTHING`` (failures are added to ``failures``). A rank that exits closes its pipe,
        so a death is seen as the end of its pipe, and named by its exit code."""
        ready = wait([c for rank, c in enumerate(self._conns) if rank not in failures], timeout)
        for rank, conn in enumerate(self._conns):
            if conn not in ready:
                continue
            with ctrl_c_held():  # a reply read is a reply counted
                try:
                    ok, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    ok, value = False, None
                if ok and rank == 0:
                    self._pending -= 1
            if ok and rank == 0 and not failures:
                return value
            if not ok:
                failures[rank] = (
                    self._died(rank) if value is None else f"rank {rank} failed: {value}"
                )
        return _NOTHING

    def _died(self, rank: int) -> str:
        try:
            code = self._processes[rank].wait(GRACE_S)
        except subprocess.TimeoutExpired:
            return f"rank {rank} closed its pipe"
        return f"rank {rank} died ({exit_reason(code)})"


_NOTHING = object()
"""``RankedExecutor._next`` found no reply (yet)."""


@attrs.define
class RankedEngine:
    """A parallel engine: the resolution, the ``LLM`` this process drives and the ranks it
    drives them on (``ranks.capture()``, ``ranks.captured``, …). Close it, or use it as a
    context manager, to stop the ranks."""

    resolution: Resolution
    llm: LLM
    ranks: RankedExecutor
    capacity: CapacityPlan | None
    """How rank 0 derived the cache layout (every rank plans the same one)."""

    def close(self) -> None:
        self.ranks.close()

    def __enter__(self) -> RankedEngine:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def launch_engine(spec: EngineSpec) -> RankedEngine:
    """Start ``spec.tensor_parallel_size`` local ranks of ``spec`` (any size >= 1) and return
    the engine driving them; refuses what ``check_spec`` refuses, more ranks than the
    platform's devices here (``DeviceCountError``) and a platform object of a class defined in
    ``__main__`` (``PlatformNotImportableError``), before starting any."""
    resolution = check_spec(spec)
    check_local_devices(resolution.platform, spec.tensor_parallel_size)
    platform_class = type(spec.platform)
    if platform_class.__module__ == "__main__":
        raise PlatformNotImportableError(
            f"platform class {platform_class.__name__} is defined in __main__, which the ranks "
            "cannot import: move it to a module, or register it as a plugin and pass its name"
        )
    ranks = RankedExecutor(spec, process_group_backend(resolution.platform))
    try:
        with warnings.catch_warnings():  # rank 0 said them already (re-raised by RankedExecutor)
            warnings.simplefilter("ignore")
            llm = llm_of(ranks, spec, config_of(spec))
    except BaseException:
        ranks.close()
        raise
    return RankedEngine(resolution=resolution, llm=llm, ranks=ranks, capacity=ranks.capacity)


_RANK_MAIN = (
    "import dsv4_rank; dsv4_rank.exit_with_parent({parent}); "
    "import runners.ranked as r; r.serve_rank({fd})"
)
"""A rank process's program: it watches its driver before importing the library."""


def _start_rank() -> tuple[Connection, subprocess.Popen[bytes]]:
    """Start one rank process (``serve_rank``) and return the pipe to it and the process.

    A fresh interpreter, not a ``multiprocessing`` child: nothing of the caller's ``__main__``
    is imported again, so a script, ``python -c`` or a notebook may launch engines without an
    ``if __name__ == "__main__"`` guard. In its own session, so a Ctrl-C at the terminal
    reaches the driver alone; on this interpreter's module path."""
    mine, theirs = socket.socketpair()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _RANK_MAIN.format(parent=os.getpid(), fd=theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=environment,
            start_new_session=True,
        )
    finally:
        theirs.close()  # the rank holds its end: its exit closes the pipe
    return Connection(mine.detach()), process


def _shut_down(conns: list[Connection], processes: list[subprocess.Popen[bytes]]) -> None:
    """Tell every rank to stop (a closed pipe), give idle ranks a moment to leave, then
    terminate (or kill, after ``GRACE_S``) and reap whichever have not."""
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + LEAVE_S
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve_rank(fd: int) -> None:
    """A rank process's main: read its part (spec, world, backend) from the pipe at ``fd``,
    build its engine in the process group, then run what the driver sends until the pipe
    closes; rank 0 replies to each command, any rank reports its error as one line."""
    conn = Connection(fd)
    try:
        spec, world, backend = pickle.loads(conn.recv_bytes())
        if world.rank != 0:
            silence()
        if on_the_cpu(backend):
            share_threads(world.size)
        with process_group(world, backend):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                engine = build_engine(spec)
            if world.rank == 0:
                noted = tuple((w.category, str(w.message)) for w in caught)
                ready = _Ready(engine.runner.limits, engine.capacity, noted)
                conn.send_bytes(pickle.dumps((True, ready)))
            _serve_commands(engine.runner, conn, answers=world.rank == 0)
    except BaseException as exc:  # every failure reaches the driver as one line
        with contextlib.suppress(OSError):  # the driver is gone: nobody to tell
            conn.send_bytes(pickle.dumps((False, one_line(exc))))


def _serve_commands(runner: ModelRunner, conn: Connection, *, answers: bool) -> None:
    """Run the driver's commands until the pipe closes: ``map`` (rank 0: the shared logits),
    ``call`` of ``CALLS`` (``execute`` leaves its logits in the shared rows and answers their
    count), ``read`` of ``READS``; only rank 0 (``answers``) replies."""
    logits: SharedLogits | None = None
    while True:
        try:
            kind, name, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver closed the pipe, or is gone
        value: Any = None
        if kind == "map":
            logits = SharedLogits(name, *args)
        elif kind == "call" and name in CALLS:
            value = getattr(runner, name)(*args)
            if name == "execute" and logits is not None:
                value = logits.write(value)
        elif kind == "read" and name in READS:
            value = getattr(runner, name)
        else:
            raise ValueError(f"unknown command {kind} {name}")
        if answers:
            conn.send_bytes(pickle.dumps((True, value)))
