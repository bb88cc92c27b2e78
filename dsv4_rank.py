"""The first moments of a rank process: it lives no longer than its parent, and a Ctrl-C is its
parent's to handle. Imports nothing heavy, so a rank that starts as a fresh interpreter
(``launch_engine``'s, or a spawned one) watches its parent before it spends seconds importing
torch and the library.

- ``exit_with_parent``: a rank whose parent is gone (killed, crashed) exits within
  ``PARENT_POLL_S`` of it, instead of running on until a collective times out. A daemon thread
  watches the parent process id, so nothing the rank is doing (importing, a collective, a
  capture) has to cooperate.
- ``run_rank``: a ``multiprocessing`` rank's entry (``runners.distributed.run_local``): watch the
  process that started it (``multiprocessing``'s parent sentinel, a pipe that reads as closed
  once it is gone: under a fork server the operating system's parent is the server, not it),
  then unpickle the work (which imports whatever the rank has not imported yet) and run it.
- ``children_ignore_ctrl_c``: a terminal's Ctrl-C reaches every process of the foreground
  group, so ranks started by ``multiprocessing`` would each print a ``KeyboardInterrupt``
  traceback (while importing torch, say). Started inside this block, they inherit SIGINT
  blocked; the parent alone takes the Ctrl-C and stops them, and one that arrives while the
  block is open is raised in the parent when it ends, once it knows every rank it started.
- ``ctrl_c_held``: a Ctrl-C held back to the end of a block that must not stop halfway (a
  rank's start, a reply a driver reads).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EXIT_PARENT_GONE",
    "PARENT_POLL_S",
    "children_ignore_ctrl_c",
    "ctrl_c_held",
    "exit_with_parent",
    "run_rank",
]

PARENT_POLL_S = 0.2
"""How often a rank checks that its parent still lives."""
EXIT_PARENT_GONE = 1


def exit_with_parent(parent: int) -> None:
    """Exit this process (status ``EXIT_PARENT_GONE``) as soon as its parent, the process
    ``parent``, is gone (its id as the parent gave it: an orphan is adopted at once, so the
    id ``os.getppid`` returns later may already be another's)."""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_POLL_S)
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="dsv4-parent-watch", daemon=True).start()


def run_rank(work: bytes, *passed: Any) -> None:
    """Exit as soon as the process that started this one is gone; meanwhile run the pickled
    ``(function, args)`` of ``work`` with ``passed`` appended (what must travel by
    ``multiprocessing`` itself, such as a queue)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        sentinel = parent.sentinel

        def watch() -> None:
            multiprocessing.connection.wait([sentinel])
            os._exit(EXIT_PARENT_GONE)

        threading.Thread(target=watch, name="dsv4-parent-watch", daemon=True).start()
    function, args = pickle.loads(work)
    function(*args, *passed)


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then act on it as before (raise
    ``KeyboardInterrupt``, for Python's default handler). A handler of the main thread's own,
    not a signal mask: the kernel would hand a masked signal to another thread, and Python
    would still run its handler in the main thread at once. Other threads never run signal
    handlers, so they need nothing held."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None  # a handler Python did not set: leave it
    ):
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def children_ignore_ctrl_c() -> Iterator[None]:
    """Processes started inside the block have SIGINT blocked (see the module docstring); a
    Ctrl-C this process receives meanwhile is held to the block's end (``ctrl_c_held``), so the
    caller knows every process it started when it acts on it."""
    with ctrl_c_held():
        if not hasattr(signal, "pthread_sigmask"):  # no signal masks here: nothing to inherit
            yield
            return
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
