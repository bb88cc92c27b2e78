"""The README's engine-API example runs as shown (it is executed, not just read)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from runners import EngineSpec, SamplingParams, build_engine
from tests.readme.examples import README


def test_the_engine_api_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text()
    match = re.search(r"<!-- readme-python: engine-api -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match is not None, "README lost its marked engine-API example"
    exec(compile(match.group(1), "README.md:engine-api", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("0 (") and printed[2].startswith("1 (")  # two generate outputs
    assert printed[3].startswith("(") and len(printed) == 4  # the step loop's one request


def test_the_parallel_api_example_runs_as_a_script_without_a_main_guard() -> None:
    """Run as ``python -c``, which a ``multiprocessing`` spawn could not re-import."""
    text = README.read_text()
    match = re.search(r"<!-- readme-python: parallel-api -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match is not None, "README lost its marked parallel-API example"
    done = subprocess.run(
        [sys.executable, "-c", match.group(1)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    single = build_engine(EngineSpec(platform="cpu")).llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=4)
    )
    assert done.stdout.splitlines() == ["CUDAGraphMode.PIECEWISE", str(single[0].output_ids)]
