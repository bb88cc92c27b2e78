"""``--enable-prefix-caching`` (the default) and ``--no-enable-prefix-caching`` on the engine
commands; ``run --json`` reports what the cache found, and it changes no token, on one rank or
two, on a quantized checkpoint too; ``bench --prefix-cache-ttft`` measures it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.cli.main import build_parser, main
from tests.cli.test_cli import CPU, FAST, _error, _json

SYSTEM = "You are a terse assistant. Answer in one word, and never explain the answer. Q:"
"""79 bytes: the built-in model's tokens, so two prompts after it share 79 (its boundary: 64)."""
PROMPTS = ["--prompt", f"{SYSTEM} red?", "--prompt", f"{SYSTEM} blue?", "--max-new-tokens", "6"]


def test_run_reports_the_prefix_cache_and_off_changes_no_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    one_at_a_time = ["--max-num-seqs", "1"]  # the second prompt is admitted after the first
    cached = _json(capsys, ["run", *PROMPTS, *FAST, *CPU, *one_at_a_time])
    off = _json(
        capsys, ["run", *PROMPTS, *FAST, *CPU, *one_at_a_time, "--no-enable-prefix-caching"]
    )
    assert cached["engine"]["prefix_cache"] == {
        "enabled": True,
        "queries": 2,
        "hits": 1,
        "query_tokens": 2 * len(SYSTEM) + len(" red?") + len(" blue?"),
        "hit_tokens": 64,
        "cached_blocks": 2,  # the block of positions 48..63, and the entry block of 0..63
        "evicted_blocks": 0,
    }
    assert off["engine"]["prefix_cache"] == {"enabled": False}
    assert [o["output_ids"] for o in cached["outputs"]] == [o["output_ids"] for o in off["outputs"]]


@pytest.mark.parametrize("command", ["matrix", "bench", "serve"])
def test_every_engine_command_takes_the_flag(command: str) -> None:
    parser = build_parser()
    args = parser.parse_args([command, "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
    assert parser.parse_args([command]).enable_prefix_caching is True


def test_bench_times_the_first_token_with_and_without_the_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every timed request finds the whole shared prefix (a multiple of the boundary, 64) and
    computes only its own tokens; the ratio is of the medians reported (no figure is asserted)."""
    args = ["--shared-prefix-len", "128", "--suffix-len", "8", "--repeats", "2", "--threads", "1"]
    measured = _json(capsys, ["bench", "--prefix-cache-ttft", *args, *CPU])["prefix_cache_ttft"]
    assert (measured["hits"], measured["hit_tokens_per_request"]) == (2, 128)
    assert measured["computed_tokens"] == {"cached": 8, "uncached": 136}
    ttft = measured["ttft_ms"]
    assert measured["ratio"] == round(ttft["cached"] / ttft["uncached"], 4)
    assert measured["computed_ratio"] == round(8 / 136, 4)


def test_bench_refuses_two_thread_counts_for_the_prefix_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, line = _error(capsys, ["bench", "--prefix-cache-ttft", "--threads", "1,2"])
    assert code == 2 and "one thread count" in line


def test_every_rank_caches_alike(capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks each schedule the same steps (the scheduling is host-side and the keys are
    sha256, not a per-process hash), so both find the same 64 tokens and give one rank's
    tokens."""
    argv = ["run", *PROMPTS, *FAST, *CPU, "--max-num-seqs", "1"]
    one = _json(capsys, argv)
    two = _json(capsys, [*argv, "--tensor-parallel-size", "2"])
    assert two["engine"]["prefix_cache"] == one["engine"]["prefix_cache"]
    assert one["engine"]["prefix_cache"]["hit_tokens"] == 64
    assert [o["output_ids"] for o in two["outputs"]] == [o["output_ids"] for o in one["outputs"]]


def test_a_quantized_checkpoint_caches_alike(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """FP8 linears and MXFP4 experts, loaded weight-only: the cache is block bookkeeping, so
    it finds the same 64 tokens and changes no token."""
    directory = tmp_path / "fp4"
    assert main(["init-checkpoint", str(directory), "--quantization", "fp8-fp4"]) == 0
    capsys.readouterr()
    ids = [f"--prompt-ids={','.join(map(str, (SYSTEM + q).encode()))}" for q in (" red?", " blue?")]
    argv = ["run", *ids, "--checkpoint", str(directory), *FAST, *CPU, "--max-num-seqs", "1"]
    cached = _json(capsys, [*argv, "--max-new-tokens", "4"])
    off = _json(capsys, [*argv, "--max-new-tokens", "4", "--no-enable-prefix-caching"])
    assert cached["engine"]["prefix_cache"]["hit_tokens"] == 64
    assert [o["output_ids"] for o in cached["outputs"]] == [o["output_ids"] for o in off["outputs"]]
