"""The console entry point turns on torch's transparent huge pages before torch is imported,
unless the environment already chose: checked in a fresh interpreter, as the command runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsv4_cli import HUGE_PAGES

PROBE = """
import os, sys
import dsv4_cli
original = dsv4_cli.prefer_huge_pages
def spy():
    sys.stderr.write(f"torch imported before: {'torch' in sys.modules}\\n")
    original()
    sys.stderr.write(f"setting: {os.environ.get(dsv4_cli.HUGE_PAGES)}\\n")
dsv4_cli.prefer_huge_pages = spy
sys.argv = ["dsv4", "--help"]
raise SystemExit(dsv4_cli.main())
"""


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("0", "0"), ("1", "1")])
def test_huge_pages_are_on_unless_the_environment_says(given: str | None, seen: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES}
    if given is not None:
        env[HUGE_PAGES] = given
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert done.stderr.splitlines() == ["torch imported before: False", f"setting: {seen}"]
