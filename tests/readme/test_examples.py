"""Every fenced block of the README and of ``docs/`` is run by the suite (``examples.py`` places
each), every ``$ dsv4 …`` example shows what that command prints today, quick-start checkpoints
go where git ignores them, and the pages' links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme.examples import (
    CLAIMED,
    NOT_RUN,
    ROOT,
    Example,
    Outputs,
    all_blocks,
    blocks,
    command_lines,
    comparable,
    examples,
    pages,
)

EXAMPLES = examples()
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_of_a_page_is_an_example_the_suite_runs(page: Path) -> None:
    unplaced = [b.where for b in blocks(page) if b.kind == "unplaced"]
    assert unplaced == [], (
        "blocks nobody runs: make each a `$ dsv4 …` text example or mark it with "
        "<!-- example: python|plugin|shell NAME --> (tests/readme/examples.py)"
    )


def test_the_readme_has_examples_and_the_docs_pages_exist() -> None:
    assert len([e for e in EXAMPLES if e.block.page.name == "README.md"]) >= 3
    names = {p.name for p in pages()}
    assert {"cli.md", "checkpoints.md", "capacity.md", "parallelism.md", "platforms.md"} <= names
    assert {"design.md", "benchmarks.md", "python-api.md", "testing.md"} <= names


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    return Outputs(tmp_path_factory.mktemp("docs"))


@pytest.mark.xdist_group("docs-outputs")  # one scratch directory, examples in reading order
@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.block.where} {e.line}" for e in EXAMPLES])
def test_an_example_is_the_commands_real_output(example: Example, outputs: Outputs) -> None:
    assert comparable(outputs.of(example)) == comparable(example.shown), (
        f"{example.block.where} is stale; regenerate with: python -m tests.readme.examples --write"
    )


def test_every_block_not_run_is_still_on_its_page() -> None:
    found = {(str(b.page.relative_to(ROOT)), b.name) for p in pages() for b in blocks(p)}
    for page, start in NOT_RUN:
        assert any(p == page and name.startswith(start) for p, name in found), (page, start)


def test_the_serving_page_marks_its_steps_for_its_test() -> None:
    serving = [b for b in all_blocks("serving")]
    assert serving and {b.page.name for b in serving} == {"serving.md"}
    runner = (ROOT / "tests/serve/test_serving_doc.py").read_text()
    assert "<!-- serving-doc:" in runner


def test_a_claimed_shell_block_is_run_by_its_test_module() -> None:
    names = {b.name for b in all_blocks("shell")}
    for name, module in CLAIMED.items():
        assert name in names, f"no page has the shell block {name!r} {module} runs"
        assert f'shell_block("{name}")' in (ROOT / module).read_text()


def _checkpoint_dirs() -> list[tuple[str, str]]:
    """(where, DIR) of every ``init-checkpoint DIR`` a page tells a reader to run."""
    found = [(e.block.where, e.argv[1]) for e in EXAMPLES if e.argv[0] == "init-checkpoint"]
    for block in all_blocks("shell"):
        for argv in command_lines(block):
            if argv[:2] == ["dsv4", "init-checkpoint"]:
                found.append((block.where, argv[2]))
    return found


def test_quick_start_checkpoints_go_where_git_ignores_them() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/checkpoints/" in ignored
    written = _checkpoint_dirs()
    assert written
    assert [(w, d) for w, d in written if not d.startswith("checkpoints/")] == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file(page: Path) -> None:
    broken = []
    for target, _ in _LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        if not path.exists():
            broken.append(target)
    assert broken == []
