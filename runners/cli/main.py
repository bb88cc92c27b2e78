"""Argument parsing and dispatch for the ``dsv4`` command.

Each command module exposes ``add_arguments(parser)``, ``execute(args) -> dict`` (the JSON
payload) and ``render(payload) -> str`` (the human-readable form), and may expose
``exit_code(payload) -> int`` when a finished run can still fail (``matrix`` as a gate). ``main``
prints the payload or its rendering and turns every failure into one line on stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import runners.cli.bench as bench
import runners.cli.bench_load as bench_load
import runners.cli.bench_serve as bench_serve
import runners.cli.explain as explain
import runners.cli.init_checkpoint as init_checkpoint
import runners.cli.matrix as matrix
import runners.cli.run as run
import runners.cli.serve as serve
from dsv4.parallel import check_parallel_size
from runners.cli.errors import EXIT_CLOSED_PIPE, UsageError, report_failure, stdout_closed
from runners.cli.options import parallel_backend
from runners.distributed import check_local_devices, execute_ranked, torchrun_world
from runners.spec import EngineSpec, config_of, resolve_platform

__all__ = ["build_parser", "main"]

COMMANDS: dict[str, ModuleType] = {
    "run": run,
    "explain": explain,
    "matrix": matrix,
    "bench": bench,
    "bench-load": bench_load,
    "init-checkpoint": init_checkpoint,
    "serve": serve,
    "bench-serve": bench_serve,
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (raised, not printed with the usage)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dsv4",
        description=(
            "Serve DeepSeek-V4 models with breakable graph capture. The eager region of each "
            "attention layer is resolved from the (platform, model runner) pair; 'explain' "
            "shows how, 'matrix' proves every allowed combination equal to eager."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in COMMANDS.items():
        doc = (module.__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else name
        command = sub.add_parser(
            name,
            help=summary,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--json", action="store_true", help="print exactly one JSON object on stdout"
        )
        module.add_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsv4`` command line; return the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command_name = args_list[0] if args_list and not args_list[0].startswith("-") else ""
    with warnings.catch_warnings():
        warnings.showwarning = functools.partial(_warning_line, command_name)
        return _run(command_name, args_list)


def _warning_line(command: str, message: Warning | str, *args: object, **kwargs: object) -> None:
    """A warning as one line on stderr (``dsv4 run: warning: ...``), never a source excerpt."""
    prefix = f"dsv4 {command}" if command else "dsv4"
    print(f"{prefix}: warning: {message}", file=sys.stderr)


def _run(command_name: str, args_list: list[str]) -> int:
    try:
        args = build_parser().parse_args(args_list)
        if args.command is None:
            raise UsageError("a command is required: " + ", ".join(COMMANDS))
        module = COMMANDS[args.command]
        payload = _execute(module, args)
        if payload is None:  # a rank other than 0 of a parallel run: rank 0 speaks
            return 0
        if args.json:
            print(json.dumps(payload, sort_keys=False))
        else:
            print(module.render(payload))
        sys.stdout.flush()  # a reader that went away is found here, not at interpreter exit
    except KeyboardInterrupt:
        print(f"dsv4 {command_name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _raised_by_an_interrupt(exc):  # a library turned Ctrl-C into its own error
            print(f"dsv4 {command_name}: interrupted", file=sys.stderr)
            return 130
        if isinstance(exc, BrokenPipeError) and stdout_closed():
            return EXIT_CLOSED_PIPE  # `dsv4 … | head`: the reader has what it wanted
        return report_failure(command_name or "", exc)
    exit_code = getattr(module, "exit_code", None)
    return int(exit_code(payload)) if exit_code is not None else 0


def _raised_by_an_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while handling a ``KeyboardInterrupt``, or from one (its
    chain of causes and contexts holds one): Ctrl-C, whatever the code it landed in made of it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


PARALLEL_COMMANDS = frozenset({"run", "matrix", "bench"})
"""The commands that build engines, so run on every rank of a parallel run; under ``torchrun``
any other runs on rank 0 alone."""


def _execute(module: ModuleType, args: argparse.Namespace) -> dict[str, Any] | None:
    """``module.execute(args)``, on every rank of a parallel run (``runners.distributed``)."""
    world = torchrun_world()
    if args.command not in PARALLEL_COMMANDS:
        return dict(module.execute(args)) if world is None or world.rank == 0 else None
    size = args.tensor_parallel_size
    if size == 1 and world is None:
        return dict(module.execute(args))
    platforms_of = getattr(module, "parallel_platforms", lambda a: [a.platform])
    if world is None:  # refuse what cannot run before any process starts
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        check_parallel_size(config_of(EngineSpec(checkpoint=checkpoint)), size)
        for name in platforms_of(args):
            check_local_devices(resolve_platform(name, simulated=args.simulate), size)
    backend = parallel_backend(platforms_of(args), simulate=args.simulate)
    return execute_ranked(module.execute, args, size, backend)


if __name__ == "__main__":
    raise SystemExit(main())
