"""The documented out-of-tree platform package, built, installed and tested as its author would.

The package's files are the code blocks of ``docs/platforms.md`` marked ``<!-- example: plugin PATH
-->`` (``tests.readme.examples``), written verbatim, so the example cannot rot. It is installed with
pip (offline, no build isolation, no dependencies: this project is already installed) into a target
directory put on ``PYTHONPATH``; entry points are discovered from the ``.dist-info`` pip writes
there. Then, each in a fresh process as a user would run it: ``dsv4 explain`` for the plugin and a
built-in, the conformance kit in the package (no ``conftest.py`` of ours: the kit's own settings),
and two wrong claims the kit must refute within a minute, naming what is wrong.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.readme.examples import all_blocks

PACKAGE_FILES = ("mypkg/__init__.py", "pyproject.toml", "tests/test_mydev.py")
KIT_SECONDS = 60.0
"""What the kit may take in the package, in CPU seconds: a minute of work on a 2-core machine."""

WRONG_CLAIMS = '''
"""Two wrong claims about the documented platform; the kit must refute each within a minute."""

from graphs import FullGraph
from mypkg import MyPlatform
from platforms.cpu import tape_backend
from runners.testing import PlatformConformanceTests


class TestWrongFlag(PlatformConformanceTests):
    required_region = "narrow"  # wrong: MyPlatform requires the wide region
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

    def make_platform(self):
        return MyPlatform()


class ReplayOnceSegment:
    def __init__(self, inner):
        self.inner = inner
        self.replays = 0

    def replay(self):
        if self.replays == 0:
            self.inner.replay()
        self.replays += 1


class ReplayOnceBackend:
    """The tape, except that each segment replays only once: later replays leave its memory as
    the first left it (as a device whose graph launches silently stop would)."""

    name = "replay-once"

    def __init__(self, inner):
        self.inner = inner

    @property
    def pool(self):
        return self.inner.pool

    def begin_segment(self):
        self.inner.begin_segment()

    def end_segment(self):
        segment = self.inner.end_segment()
        return None if segment is None else ReplayOnceSegment(segment)

    def abort_segment(self):
        self.inner.abort_segment()

    def hold(self, value):
        return self.inner.hold(value)

    def release(self, held):
        return self.inner.release(held)

    def warm_up(self, fn):
        self.inner.warm_up(fn)


class BrokenReplayPlatform(MyPlatform):
    name = "brokendev"
    eager_region_strategy = FullGraph()  # wrong: its captures do not replay

    def create_graph_backend(self, pool):
        return ReplayOnceBackend(tape_backend(pool))


class TestBrokenReplay(PlatformConformanceTests):
    excludes_from_v2 = frozenset({"DeepseekV4ForCausalLM"})

    def make_platform(self):
        return BrokenReplayPlatform()
'''


def documented_package_files() -> dict[str, str]:
    """The documented package's blocks by file path; a missing one fails naming the marker."""
    blocks = {block.name: block.body for block in all_blocks("plugin")}
    missing = [path for path in PACKAGE_FILES if path not in blocks]
    if missing or len(blocks) != len(PACKAGE_FILES):
        pytest.fail(
            f"the docs lack the plugin blocks {missing} (or have others: {sorted(blocks)}): "
            "each is a fenced code block right after a line '<!-- example: plugin PATH -->' in "
            "docs/platforms.md"
        )
    return {path: blocks[path] for path in PACKAGE_FILES}


REAPER = """
import ctypes, os, resource, subprocess, sys
try:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans are reaped here
except (OSError, AttributeError):
    pass
code = subprocess.call(sys.argv[1:])
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"cpu-seconds {usage.ru_utime + usage.ru_stime}", file=sys.stderr)
sys.exit(code)
"""
"""Runs a command and reports the CPU seconds of every process it started, those a fork server
started included (they outlive their parent, so no one else would count them)."""


def run(command: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str, float]:
    """Run ``command``; return its exit code, stdout, all output (stdout, stderr) and the CPU
    seconds it and its descendants used: the work, whatever else shares the machine, so a bound
    on it holds on a busy CI host."""
    done = subprocess.run(
        [sys.executable, "-c", REAPER, *command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    stderr, _, report = done.stderr.rstrip("\n").rpartition("\n")
    seconds = float(report.removeprefix("cpu-seconds "))
    return done.returncode, done.stdout, done.stdout + stderr, seconds


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The documented package, pip-installed into a target directory; (package dir, environment)."""
    root = tmp_path_factory.mktemp("plugin")
    package, target = root / "mypkg-src", root / "site"
    for path, text in documented_package_files().items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    pip += ["--no-build-isolation", "--target", str(target), str(package)]
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_PLATFORM", "PYTHONPATH")}
    code, _, output, _ = run(pip, env, root)
    assert code == 0, f"pip install of the documented package failed:\n{output}"
    env["PYTHONPATH"] = str(target)
    return package, env


def test_the_documented_package_is_complete_code() -> None:
    files = documented_package_files()
    for path in ("mypkg/__init__.py", "tests/test_mydev.py"):
        tree = ast.parse(files[path], filename=path)
        stubs = [
            f.name
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
            and len(f.body) == 1
            and isinstance(f.body[0], ast.Expr)
            and isinstance(f.body[0].value, ast.Constant)
            and f.body[0].value.value is Ellipsis
        ]
        assert not stubs, f"docs/platforms.md {path}: {stubs} have '...' bodies; show working code"
    assert '"dsv4.platforms"' in files["pyproject.toml"]


def dsv4(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("dsv4")
    assert script.exists(), f"the dsv4 console script is not installed next to {sys.executable}"
    return [str(script), *args]


@pytest.mark.slow
def test_explain_resolves_the_plugin_and_the_builtins(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    _, env = installed
    code, stdout, output, _ = run(dsv4("explain", "--platform", "mydev", "--json"), env, tmp_path)
    assert code == 0, output
    payload = json.loads(stdout)
    assert (payload["platform"], payload["runner"], payload["eager_region"]) == (
        "mydev",
        "v1",
        "wide",
    )
    code, _, output, _ = run(dsv4("explain", "--platform", "cpu"), env, tmp_path)
    assert code == 0, f"dsv4 explain --platform cpu with the plugin installed:\n{output}"


@pytest.mark.slow
def test_the_kit_passes_in_the_package_within_a_minute(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    package, env = installed
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    code, _, output, seconds = run([*command, str(package / "tests")], env, tmp_path)
    assert code == 0 and re.search(r"\b\d+ passed\b", output), output
    assert seconds < KIT_SECONDS, f"the kit took {seconds:.1f} CPU s in the package:\n{output}"


@pytest.mark.slow
def test_wrong_claims_fail_within_a_minute_naming_what_is_wrong(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    _, env = installed
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "test_wrong_claims.py").write_text(textwrap.dedent(WRONG_CLAIMS))
    select = "TestWrongFlag and policy or TestBrokenReplay and every_allowed"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select]
    code, _, output, seconds = run([*command, str(tmp_path / "wrong")], env, tmp_path)
    assert code == 1 and "2 failed" in output, output
    assert seconds < KIT_SECONDS, f"refuting the claims took {seconds:.1f} CPU s:\n{output}"
    # The flag: both values, the test's and the platform's.
    assert re.search(
        r"platform mydev: the test class says required_region = 'narrow', "
        r"the platform's eager_region_strategy is 'wide'",
        output,
    ), output
    # The broken replay: the platform, a configuration and the first differing token.
    assert re.search(
        r"platform brokendev \(on its cpu device\): \d+ of \d+ allowed configurations differ",
        output,
    ), output
    assert re.search(
        r"runner v[12], graph mode \w+, region [\w-]+ \(resolved: [^)]*\): prompt \d+ \[[\d, ]+\]: "
        r"first differing token at output \d+ \(sequence position \d+\): expected \d+, got \d+",
        output,
    ), output
