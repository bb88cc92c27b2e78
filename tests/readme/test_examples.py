"""Every ``$ dsv4 …`` example in the README shows what that command prints today."""

from __future__ import annotations

import pytest

from tests.readme.examples import README, Example, comparable, examples, run

EXAMPLES = examples(README.read_text())


def test_the_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.line for e in EXAMPLES])
def test_a_readme_example_is_the_commands_real_output(example: Example) -> None:
    assert comparable(run(example)) == comparable(example.shown), (
        "README example is stale; regenerate with: python -m tests.readme.examples --write"
    )
