"""docs/prefix-caching.md shows what its ``$ dsv4 …`` examples print today (the README's rule,
``tests/readme/examples.py``: every number on a ``timing:`` line compares as ``N``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.readme.examples import Example, comparable, examples, run

DOC = Path(__file__).resolve().parents[2] / "docs" / "prefix-caching.md"
EXAMPLES = examples(DOC.read_text())


def test_the_page_has_its_example() -> None:
    assert len(EXAMPLES) == 1
    assert "prefix cache: 64 of 169 prompt tokens found cached" in EXAMPLES[0].shown


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.line for e in EXAMPLES])
def test_an_example_is_the_commands_real_output(example: Example) -> None:
    assert comparable(run(example)) == comparable(example.shown)
