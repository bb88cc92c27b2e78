"""The Python examples of the README and of ``docs/`` run as shown: each ``<!-- example: python
NAME -->`` block is executed as a script (in a scratch directory), and what it prints is checked
against a reference where its name is known here."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from runners import EngineSpec, SamplingParams, build_engine
from tests.readme.examples import Block, all_blocks, in_directory

PYTHON = all_blocks("python")
FRESH = {"parallel-api"}
"""Run in a fresh interpreter (``python -c``): its claim is that a script needs no main guard."""


def _printed(block: Block, directory: Path) -> list[str]:
    if block.name in FRESH:
        done = subprocess.run(
            [sys.executable, "-c", block.body],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=240,
            check=True,
        )
        return done.stdout.splitlines()
    out = io.StringIO()
    with in_directory(directory), contextlib.redirect_stdout(out):
        exec(compile(block.body, block.where, "exec"), {"__name__": "__main__"})
    return out.getvalue().splitlines()


def test_the_examples_the_checks_below_name_exist() -> None:
    assert {"engine-api", "parallel-api", "model-api"} <= {b.name for b in PYTHON}


@pytest.mark.parametrize("block", PYTHON, ids=[f"{b.where} {b.name}" for b in PYTHON])
def test_a_python_example_runs(block: Block, tmp_path: Path) -> None:
    printed = _printed(block, tmp_path)
    if block.name == "engine-api":
        assert printed[1].startswith("0 (") and printed[2].startswith("1 (")  # generate's two
        assert printed[3].startswith("(") and len(printed) == 4  # the step loop's one request
    elif block.name == "parallel-api":
        single = build_engine(EngineSpec(platform="cpu")).llm.generate(
            [[1, 2, 3]], SamplingParams(max_tokens=4)
        )
        assert printed == ["CUDAGraphMode.PIECEWISE", str(single[0].output_ids)]
    elif block.name == "model-api":
        assert printed == ["(5, 320)"]  # five positions, the tiny vocabulary
