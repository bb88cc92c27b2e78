"""The command lines of the README and of ``docs/`` run: each ``<!-- example: shell NAME -->``
block's lines, in order, in a scratch directory, each exiting 0 (``dsv4 …`` as the ``dsv4``
script runs it, ``python -m …`` in this interpreter). A block in ``CLAIMED`` is run by its own
test module instead.

Measurements are run at a smoke scale: ``SMOKE`` appends options (argparse keeps the last of a
repeated option) so a benchmark of minutes takes seconds on the ``tiny`` preset. The command is
the documented one; only its counts and sizes shrink.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

import pytest

from tests.readme.examples import CLAIMED, Block, all_blocks, command_lines, dsv4, in_directory

SHELL = [b for b in all_blocks("shell") if b.name not in CLAIMED]
SMOKE: dict[tuple[str, ...], list[str]] = {
    ("dsv4", "init-checkpoint"): ["--preset", "tiny"],
    ("dsv4", "bench", "--context-sweep"): [
        *("--contexts", "32,64", "--max-model-len", "1024", "--prefill-tokens", "64"),
        *("--repeats", "1", "--threads", "1", "--max-num-batched-tokens", "32"),
        *("--in-flight-output", "16"),
    ],
    ("dsv4", "bench", "--prefix-cache-ttft"): [
        *("--shared-prefix-len", "64", "--suffix-len", "8", "--repeats", "1", "--threads", "1"),
        *("--max-num-batched-tokens", "64"),
    ],
    ("dsv4", "bench"): [
        *("--repeats", "1", "--rounds", "1", "--batch-sizes", "1", "--threads", "1"),
        *("--generate-prompts", "1", "--max-new-tokens", "2", "--max-model-len", "512"),
    ],
    ("python", "-m", "graphs.bench"): ["--rounds", "1", "--calls", "1", "--smallest-only"],
}
"""Options appended to a command that starts with the key (the longest key that matches)."""


def smoke(argv: list[str]) -> list[str]:
    """``argv`` at the smoke scale (``SMOKE``)."""
    matches = [key for key in SMOKE if all(word in argv for word in key) and argv[0] == key[0]]
    return [*argv, *SMOKE[max(matches, key=len)]] if matches else argv


def run_line(argv: list[str]) -> None:
    """Run one command line in this process; it must exit 0."""
    if argv[0] == "dsv4":
        code, _ = dsv4(argv[1:])
        assert code == 0, f"exit {code}: {' '.join(argv)}"
    elif argv[:2] == ["python", "-m"]:
        saved = sys.argv
        sys.argv = [argv[2], *argv[3:]]
        try:
            with warnings.catch_warnings():  # "found in sys.modules": it was imported, fine
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(argv[2], run_name="__main__", alter_sys=False)
        except SystemExit as stop:
            assert stop.code in (0, None), f"exit {stop.code}: {' '.join(argv)}"
        finally:
            sys.argv = saved
    else:
        raise AssertionError(f"no way to run {argv[0]!r} here; claim the block (CLAIMED)")


def test_smoke_options_shrink_what_they_match() -> None:
    assert smoke(["dsv4", "bench", "--context-sweep"])[-2:] == ["--in-flight-output", "16"]
    assert smoke(["dsv4", "bench", "--json"])[-2:] == ["--max-model-len", "512"]
    assert smoke(["dsv4", "run"]) == ["dsv4", "run"]


@pytest.mark.parametrize("block", SHELL, ids=[f"{b.where} {b.name}" for b in SHELL])
def test_a_documented_command_block_runs(block: Block, tmp_path: Path) -> None:
    with in_directory(tmp_path):
        for argv in command_lines(block):
            run_line(smoke(argv))
