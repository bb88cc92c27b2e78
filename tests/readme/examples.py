"""The examples of the README and of ``docs/*.md``: every fenced block is one, and each is run.

A block is placed by what it is, or by an HTML comment on the line before it:

- ``text`` whose first line is ``$ dsv4 …``: that command's output, regenerated from a real run
  (``python -m tests.readme.examples --write``) and compared by ``test_examples.py``. Timings
  are the one thing a rerun cannot reproduce: on lines that start with ``timing:`` every number
  is compared as ``N``. A ``#`` after the command starts a note, not passed to the command.
- ``<!-- example: python NAME -->``: a script, run by ``test_python_examples.py``.
- ``<!-- example: plugin PATH -->``: a file of the platform package that
  ``tests/platforms/test_plugin_package.py`` builds, installs and tests.
- ``<!-- example: shell NAME -->``: command lines, run by ``test_shell_examples.py`` (or, for
  a block named in ``CLAIMED``, by the test module named there).
- ``<!-- serving-doc: NAME -->``: a step of ``docs/serving.md``, which
  ``tests/serve/test_serving_doc.py`` runs in order against a live server.

Any other block is an example nobody runs, and a test fails on each — except the few
``NOT_RUN`` lists, each with the reason it cannot run and what checks it instead.
The output examples of all pages run in order (README first, then ``docs/`` by name) in one
scratch directory, as a reader would type them, in this process (``runners.cli.main.main`` is
what the ``dsv4`` script calls).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLAIMED = {
    "tensor-parallel": "tests/cli/test_tensor_parallel_cli.py",
    "reproduce": "tests/cli/test_bench.py",
}
"""Shell blocks run by a test module of their own (which calls ``shell_block(NAME)``)."""

_FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
_MARKER = re.compile(r"<!-- (?:example: (python|plugin|shell)|(serving)-doc:) (\S+) -->")
NOT_RUN = {
    ("docs/serving.md", "dsv4 serve: serving './tiny' on http://127.0.0.1:8000"): (
        "the line the server block prints when ready; tests/serve waits for exactly it"
    ),
    (
        "docs/serving.md",
        '{"id":"cmpl-…","object":"text_completion","created":…,"model":"./tiny",',
    ): ("the shape of a reply, elided (…); tests/serve checks every field of real replies"),
    ("docs/benchmarks-serving.md", "dsv4 init-checkpoint ./tiny --preset tiny --seed 0"): (
        "a record of a measurement that takes minutes; serving.md's marked bench blocks run "
        "the same commands (transformers serve's under the slow marker)"
    ),
}
"""Blocks nobody runs, by (page, the start of their first line): why, and what checks them."""
_NUMBER = re.compile(r"\d+(\.\d+)?")


def pages() -> list[Path]:
    """The README, then every page of ``docs/`` by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


@attrs.frozen
class Block:
    """One fenced block: where it is, what it is (``kind``, ``name``) and what it holds."""

    page: Path
    line: int
    lang: str
    body: str
    kind: str
    """``output``, ``python``, ``plugin``, ``shell``, ``serving``, ``not-run`` or ``unplaced``."""
    name: str
    start: int
    end: int

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each placed (see the module docstring)."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        before = text[: match.start()].rstrip("\n").rpartition("\n")[2]
        marker = _MARKER.fullmatch(before.strip())
        if marker is not None:
            kind, name = marker.group(1) or marker.group(2), marker.group(3)
        elif lang == "text" and body.startswith("$ dsv4 "):
            kind, name = "output", body.splitlines()[0]
        elif _not_run(page, body):
            kind, name = "not-run", body.splitlines()[0]
        else:
            kind, name = "unplaced", ""
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, lang, body, kind, name, match.start(), match.end()))
    return found


def _not_run(page: Path, body: str) -> bool:
    where = str(page.relative_to(ROOT))
    return any(where == p and body.startswith(start) for p, start in NOT_RUN)


def all_blocks(kind: str) -> list[Block]:
    """The blocks of ``kind`` on every page, in reading order."""
    return [b for page in pages() for b in blocks(page) if b.kind == kind]


def shell_block(name: str) -> Block:
    """The one ``<!-- example: shell NAME -->`` block (``LookupError`` if there is none)."""
    (found,) = [b for b in all_blocks("shell") if b.name == name] or [None]
    if found is None:
        raise LookupError(f"no page has a block marked <!-- example: shell {name} -->")
    return found


def command_lines(block: Block) -> list[list[str]]:
    """The commands of a shell block as argument lists: continuation lines joined, ``#`` notes
    and blank lines left out."""
    joined = block.body.replace("\\\n", " ")
    lines = [line.split("  #", 1)[0].strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


@attrs.frozen
class Example:
    """One output example: the command line as shown, and the output shown under it."""

    block: Block

    @property
    def line(self) -> str:
        return self.block.body.splitlines()[0]

    @property
    def shown(self) -> str:
        return self.block.body.split("\n", 1)[1]

    @property
    def argv(self) -> list[str]:
        command = self.line.removeprefix("$ dsv4 ").split("  #", 1)[0]
        return shlex.split(command)


def examples() -> list[Example]:
    return [Example(b) for b in all_blocks("output")]


@contextlib.contextmanager
def in_directory(path: Path) -> Iterator[None]:
    """Work in ``path`` inside the block, as a reader in a fresh directory would."""
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def as_a_user() -> Iterator[None]:
    """No platform or runner chosen by the environment, as in a fresh shell."""
    saved = {k: os.environ.pop(k) for k in ("DSV4_PLATFORM", "DSV4_RUNNER") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def dsv4(argv: list[str]) -> tuple[int, str]:
    """Run ``dsv4 ARGV`` in this process (what the ``dsv4`` script does); its exit code and
    stdout (its stderr is dropped)."""
    from runners.cli.main import main

    out = io.StringIO()
    with as_a_user(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    return code, out.getvalue()


class Outputs:
    """The outputs of the output examples, run in order in one scratch directory; an example
    that needs a checkpoint an earlier one writes runs after it, whatever was asked first."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: dict[str, str] = {}

    def of(self, example: Example) -> str:
        for earlier in examples():
            if earlier == example:
                break
            if earlier.argv[:1] == ["init-checkpoint"]:
                self._run(earlier)
        return self._run(example)

    def _run(self, example: Example) -> str:
        key = shlex.join(example.argv)
        if key not in self._seen:
            with in_directory(self.directory):
                code, out = dsv4(example.argv)
            if code not in (0, 1):
                raise RuntimeError(f"{example.line}: exit {code}")
            self._seen[key] = out
        return self._seen[key]


def comparable(output: str) -> str:
    """``output`` with every number on a ``timing:`` line replaced by ``N``."""
    return "\n".join(
        _NUMBER.sub("N", line) if line.startswith("timing:") else line
        for line in output.rstrip("\n").splitlines()
    )


def regenerate(page: Path, outputs: Outputs) -> str:
    """``page`` with every output example's output replaced by a fresh run's."""
    text = page.read_text()
    for example in reversed([e for e in examples() if e.block.page == page]):
        fresh = outputs.of(example).rstrip()
        block = f"```text\n{example.line}\n{fresh}\n```\n"
        text = text[: example.block.start] + block + text[example.block.end :]
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the pages in place")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        outputs = Outputs(Path(scratch))
        for page in pages():
            fresh = regenerate(page, outputs)
            if args.write:
                page.write_text(fresh)
            else:
                print(fresh)


if __name__ == "__main__":
    main()
