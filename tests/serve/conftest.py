"""One ``dsv4 serve`` per test session (per xdist worker): a random tiny checkpoint with its toy
tokenizer and chat template, an API key, ``--max-model-len 128`` (so any request the fuzzer
makes is short), and ``dsv4 run``'s outputs for the same prompts as the reference.

Starting the server costs an import, a model build and the graph captures (several seconds), so
every test that only needs a healthy server shares this one; tests that stop or break a server
start their own.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serve.support import DSV4, ServerProcess, offline_outputs

KEY = "test-key"
MODEL_ARGS = ("--max-model-len", "128", "--capture-sizes", "1,2,4,8,16")
"""Engine options the server and the offline reference share."""
MAX_NEW_TOKENS = 24
PROMPTS = [
    "Hello",
    "The quick brown fox",
    "a",
    "DeepSeek-V4 attends sparsely to compressed entries",
    "1 2 3 4 5 6 7 8 9 10",
    "héllo wörld €",
    "Once upon a time, in a land far away,",
    "zzz",
    "What is the capital of France?",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit",
    "<>{}[]()",
    "tiny",
    "breakable graph capture",
    "ok",
    "The end.",
    "Sixteen concurrent streams",
    "one more, the seventeenth",
]
"""Prompts of different lengths (one to ~14 tokens of the toy tokenizer, one multi-byte)."""


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("serve") / "ckpt"
    subprocess.run(
        [*DSV4, "init-checkpoint", str(directory), "--preset", "tiny", "--seed", "0"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return directory


@pytest.fixture(scope="session")
def model_name(checkpoint: Path) -> str:
    return str(checkpoint)


@pytest.fixture(scope="session")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--checkpoint",
        str(checkpoint),
        "--api-key",
        KEY,
        "--max-request-bytes",
        "64KiB",
        *MODEL_ARGS,
    )
    try:
        yield process
    finally:
        code, _ = process.stop()
        assert code == 0, process.stderr


@pytest.fixture(scope="session")
def offline(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """``dsv4 run``'s greedy output for each of ``PROMPTS`` (all batched in one run)."""
    args = ["--checkpoint", str(checkpoint), "--max-new-tokens", str(MAX_NEW_TOKENS), *MODEL_ARGS]
    return dict(zip(PROMPTS, offline_outputs(args, PROMPTS), strict=True))
