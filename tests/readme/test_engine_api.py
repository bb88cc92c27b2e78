"""The README's engine-API example runs as shown (it is executed, not just read)."""

from __future__ import annotations

import re

import pytest

from tests.readme.examples import README


def test_the_engine_api_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text()
    match = re.search(r"<!-- readme-python: engine-api -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match is not None, "README lost its marked engine-API example"
    exec(compile(match.group(1), "README.md:engine-api", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("0 (") and printed[2].startswith("1 (")  # two generate outputs
    assert printed[3].startswith("(") and len(printed) == 4  # the step loop's one request
