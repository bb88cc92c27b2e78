"""The ``dsv4`` console entry point: one line on Ctrl-C at any moment, start-up included.

Importing the CLI imports torch and the whole library, which takes seconds; a Ctrl-C then
would print a long traceback from inside the import machinery. This module imports nothing
heavy itself, so it can catch the interrupt wherever it lands — while importing, resolving,
capturing, generating or printing — and turn it into one line on stderr and exit code 130.
During the start-up imports the interrupt exits at once from a signal handler: some imported
libraries run ``except:`` clauses that would swallow a ``KeyboardInterrupt`` raised there.

Before torch is imported it applies ``DSV4_KERNEL_ISA`` (``dsv4_isa``: one line and exit code
2 for an instruction set that is unknown or that the CPU lacks), and it asks torch to back its
CPU allocations of 2 MiB and more with transparent huge pages (``prefer_huge_pages``).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import dsv4_isa

__all__ = ["HUGE_PAGES", "main", "prefer_huge_pages"]

EXIT_INTERRUPTED = 130
EXIT_USAGE = 2

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""torch's switch (read once, at its first CPU allocation) for aligning CPU allocations of 2 MiB
and more to 2 MiB and advising the kernel to back them with transparent huge pages."""


def prefer_huge_pages() -> None:
    """Turn ``HUGE_PAGES`` on unless the environment already says either way. A decode step
    streams every weight it uses once; with 4 KiB pages that is a TLB miss per page (a two-level
    walk under a hypervisor). On the 2-core development machine the `small` preset's FULL decode
    step at batch 1 took 2.4-2.6 ms with huge pages against 3.2-3.8 ms without (docs/benchmarks.md).
    Where the kernel gives no huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is
    ``never``) nothing changes."""
    os.environ.setdefault(HUGE_PAGES, "1")


def main() -> int:
    """Run ``dsv4`` with the process's arguments; return its exit code."""
    named = len(sys.argv) > 1 and not sys.argv[1].startswith("-")
    line = f"{'dsv4 ' + sys.argv[1] if named else 'dsv4'}: interrupted\n"

    def exit_at_once(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write(line)
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if interruptible:
        signal.signal(signal.SIGINT, exit_at_once)
    try:
        prefer_huge_pages()
        dsv4_isa.apply_requested()
        from runners.cli.main import main as run_cli

        if interruptible:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return run_cli(sys.argv[1:])
    except KeyboardInterrupt:
        sys.stderr.write(line)
        return EXIT_INTERRUPTED
    except dsv4_isa.KernelIsaError as error:
        sys.stderr.write(f"{'dsv4 ' + sys.argv[1] if named else 'dsv4'}: error: {error}\n")
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
