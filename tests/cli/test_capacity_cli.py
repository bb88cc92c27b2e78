"""Capacity flags on the CLI: ``run --json`` reports the derived layout, the capped default
context is one note line, and a capacity that cannot be served is one error line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.cache import cache_bytes
from dsv4.config import DeepseekV4Config
from runners.cli.main import main

RUN = ["run", "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--platform", "cpu"]
FAST = ["--capture-sizes", "1,2", "--threads", "1"]


def _run_output(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main([*argv, "--json"]) == 0
    return capsys.readouterr().out


def _block_bytes(block_size: int) -> tuple[int, int]:
    config = DeepseekV4Config.tiny()
    sizes = [cache_bytes(config, torch.float32, block_size)[t] for t in config.layer_types]
    return (
        block_size * sum(s.per_token for s in sizes),
        sum(s.per_entry_block for s in sizes),
    )


def test_run_json_reports_the_layout_the_flags_derive(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = ",".join(str(i % 200) for i in range(70))
    argv = [
        *RUN[:2],
        prompt,
        *RUN[3:],
        *FAST,
        "--max-model-len",
        "96",
        "--max-num-seqs",
        "3",
        "--block-size",
        "8",
        "--max-num-batched-tokens",
        "24",
        "--kv-cache-memory",
        "64MiB",
        "--first-context-bucket",
        "32",
        "--json",
    ]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    block, entry = _block_bytes(8)
    # per request: ceil((lookback 16 - 1 + chunk 24) / 8) + 1 = 6 blocks, 96 // 4 = 24 entries
    assert payload["capacity"] == {
        "max_model_len": 96,
        "max_num_seqs": 3,
        "block_size": 8,
        "num_blocks": 3 * 6,
        "num_entry_blocks": 3 * 3,
        "max_blocks_per_seq": 12,
        "kv_cache_bytes": 3 * 6 * block + 3 * 3 * entry,
        "kv_budget_bytes": 64 * 2**20,
        "block_bytes": block,
        "entry_block_bytes": entry,
        "note": None,
    }
    # buckets of 32, 64 and 96 tokens (4, 8 and 12 blocks); the run reaches 72 positions, so
    # all three are captured ahead of time
    assert payload["graphs"]["captured_contexts"] == [32, 64, 96]
    short = json.loads(_run_output(capsys, [*RUN, *FAST, "--first-context-bucket", "32"]))
    assert short["graphs"]["captured_contexts"] == [32]  # 5 positions: the first bucket only


def test_no_full_graph_is_captured_above_max_num_seqs(capsys: pytest.CaptureFixture[str]) -> None:
    """FULL graphs serve uniform-decode batches, at most --max-num-seqs tokens (padded): a FULL
    size above the one 4 tokens pad to could never replay. PIECEWISE keeps every size (the five
    prompts' steps may carry up to 15 tokens)."""
    argv = ["run", *["--prompt-ids", "1,2,3"] * 5, "--max-new-tokens", "1", "--platform", "cpu"]
    options = ["--max-num-seqs", "4", "--capture-sizes", "2,4,8", "--max-graph-contexts", "1"]
    assert main([*argv, *options, "--threads", "1", "--json"]) == 0
    captured = json.loads(capsys.readouterr().out)["graphs"]["captured"]
    assert sorted((mode, size) for mode, size, _ in captured) == [
        ("FULL", 2),
        ("FULL", 4),
        ("PIECEWISE", 2),
        ("PIECEWISE", 4),
        ("PIECEWISE", 8),
    ]


def test_a_capped_default_context_is_one_note_line(capsys: pytest.CaptureFixture[str]) -> None:
    block, entry = _block_bytes(16)
    budget = 6 * block + 5 * entry  # lookback 16 + chunk 64: 6 blocks; 5 entry blocks: 320
    assert main([*RUN, *FAST, "--kv-cache-memory", str(budget), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["capacity"]["max_model_len"] == 320
    notes = [line for line in captured.err.splitlines() if "capped" in line]
    assert len(notes) == 1 and "max-model-len capped to 320 tokens" in notes[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-model-len", "4096"], "exceeds the model's max_position_embeddings 1024"),
        (["--kv-cache-memory", "1KiB"], "holds no block of 16 tokens"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory: expected bytes"),
        (["--memory-fraction", "2"], "--memory-fraction: must be in (0, 1]"),
        (["--kv-cache-memory", "1GiB", "--memory-fraction", "0.5"], "not allowed with"),
        (["--max-num-batched-tokens", "1"], "below the largest capture size 2"),
    ],
)
def test_capacity_that_cannot_be_served_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code = main([*RUN, *FAST, *flags])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == ""
    assert len(lines) == 1 and message in lines[0], captured.err
