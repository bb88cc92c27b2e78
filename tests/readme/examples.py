"""README examples are real: each ```text block whose first line is ``$ dsv4 …`` is that
command's output, regenerated from a real run (``python -m tests.readme.examples --write``) and
compared by ``tests/readme/test_examples.py``.

Timings are the one thing a rerun cannot reproduce: on lines that start with ``timing:`` every
number is compared as ``N``. A ``#`` after the command starts a note shown in the README, not
passed to the command.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"```text\n(\$ dsv4 [^\n]*)\n(.*?)```", re.DOTALL)
_NUMBER = re.compile(r"\d+(\.\d+)?")


@attrs.frozen
class Example:
    """One README block: the command line as shown, and the output shown under it."""

    line: str
    shown: str
    start: int
    end: int

    @property
    def argv(self) -> list[str]:
        command = self.line.removeprefix("$ dsv4 ").split("  #", 1)[0]
        return shlex.split(command)


def examples(text: str) -> list[Example]:
    return [Example(m.group(1), m.group(2), m.start(), m.end()) for m in _BLOCK.finditer(text)]


def run(example: Example) -> str:
    """The command's stdout, run as a user would: the installed ``dsv4``, no platform variable."""
    dsv4 = Path(sys.executable).parent / "dsv4"
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_PLATFORM", "DSV4_RUNNER")}
    result = subprocess.run(
        [str(dsv4), *example.argv], capture_output=True, text=True, env=env, timeout=600
    )
    if result.returncode not in (0, 1):
        raise RuntimeError(f"{example.line}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def comparable(output: str) -> str:
    """``output`` with every number on a ``timing:`` line replaced by ``N``."""
    return "\n".join(
        _NUMBER.sub("N", line) if line.startswith("timing:") else line
        for line in output.rstrip("\n").splitlines()
    )


def regenerate(text: str) -> str:
    """``text`` with every example's output replaced by a fresh run's."""
    for example in reversed(examples(text)):
        block = f"```text\n{example.line}\n{run(example).rstrip()}\n```"
        text = text[: example.start] + block + text[example.end :]
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite README.md in place")
    args = parser.parse_args()
    fresh = regenerate(README.read_text())
    if args.write:
        README.write_text(fresh)
    else:
        print(fresh)


if __name__ == "__main__":
    main()
