"""Benchmark: eager vs tape replay of an attention-like block; ``python -m graphs.bench``.

The block is one decoder attention step: RMSNorm, Q/K/V projections, rotary embedding, a
KV-cache write through a slot index (``index_copy_``), masked softmax attention over the cached
positions, output projection and residual. Eager runs the ``nn.Module``; replay runs a
``BreakableCapture`` of it on the tape. Eager and replay calls are interleaved in rounds so that
drift (frequency scaling, other load) hits both alike; the figure is the median per call.
Replay is checked bit-equal to eager before anything is timed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from graphs.capture import BreakableCapture
from graphs.tape import TapeBackend

__all__ = ["SIZES", "AttentionBlock", "BenchResult", "BenchSize", "main", "measure"]


@attrs.frozen(kw_only=True)
class BenchSize:
    hidden: int
    tokens: int
    cached: int
    heads: int

    def __str__(self) -> str:
        return f"hidden {self.hidden}, {self.tokens} token(s), {self.cached} cached"


SIZES = (
    BenchSize(hidden=64, tokens=1, cached=16, heads=4),
    BenchSize(hidden=256, tokens=8, cached=512, heads=8),
    BenchSize(hidden=1024, tokens=8, cached=512, heads=16),
)


@attrs.frozen(kw_only=True)
class BenchResult:
    size: BenchSize
    threads: int
    eager_us: float
    replay_us: float

    @property
    def ratio(self) -> float:
        return self.replay_us / self.eager_us


class AttentionBlock(torch.nn.Module):
    """One attention step over a KV cache of ``cached + tokens`` positions."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, size: BenchSize) -> None:
        super().__init__()
        hidden, self.heads = size.hidden, size.heads
        self.head_dim = hidden // size.heads
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, hidden, bias=False)
        self.v = torch.nn.Linear(hidden, hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        positions = size.cached + size.tokens
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2) / self.head_dim)
        angles = torch.arange(positions)[:, None] * inv[None, :]
        self.register_buffer("cos", angles.cos().repeat(1, 2))
        self.register_buffer("sin", angles.sin().repeat(1, 2))
        self.register_buffer("k_cache", torch.randn(positions, hidden) * 0.1)
        self.register_buffer("v_cache", torch.randn(positions, hidden) * 0.1)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[positions][:, None] + rotated * self.sin[positions][:, None]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q = self._rope(self.q(h).view(tokens, self.heads, self.head_dim), positions)
        k = self._rope(self.k(h).view(tokens, self.heads, self.head_dim), positions)
        self.k_cache.index_copy_(0, positions, k.reshape(tokens, hidden))
        self.v_cache.index_copy_(0, positions, self.v(h))
        keys = self.k_cache.view(-1, self.heads, self.head_dim).permute(1, 2, 0)
        values = self.v_cache.view(-1, self.heads, self.head_dim).transpose(0, 1)
        scores = q.transpose(0, 1) @ keys / math.sqrt(self.head_dim)
        visible = torch.arange(self.k_cache.shape[0]) <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = (probs @ values).transpose(0, 1).reshape(tokens, hidden)
        return x + self.o(out)


def _per_call_us(fn: Callable[[], object], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1000)
    return times


def measure(size: BenchSize, *, threads: int = 1, rounds: int = 20, calls: int = 50) -> BenchResult:
    """Median µs per call of eager and of tape replay, interleaved over ``rounds``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        block = AttentionBlock(size)
        x = torch.randn(size.tokens, size.hidden)
        positions = torch.arange(size.cached, size.cached + size.tokens)
        with torch.inference_mode():
            with BreakableCapture(TapeBackend()) as capture:
                out = block(x, positions)
            x.copy_(torch.randn(size.tokens, size.hidden))
            capture.replay()
            if not torch.equal(out, block(x, positions)):
                raise AssertionError("tape replay differs from eager; not timing it")
            eager: list[float] = []
            replay: list[float] = []
            for _ in range(rounds):
                eager += _per_call_us(lambda: block(x, positions), calls)
                replay += _per_call_us(capture.replay, calls)
        return BenchResult(
            size=size,
            threads=threads,
            eager_us=statistics.median(eager),
            replay_us=statistics.median(replay),
        )
    finally:
        torch.set_num_threads(previous)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    parser.add_argument("--calls", type=int, default=50, help="calls per round (default 50)")
    parser.add_argument("--smallest-only", action="store_true", help="only the smallest size")
    args = parser.parse_args(argv)
    sizes = SIZES[:1] if args.smallest_only else SIZES
    print(f"{'size':<40} {'eager µs':>10} {'replay µs':>10} {'replay/eager':>13}")
    for size in sizes:
        result = measure(size, threads=args.threads, rounds=args.rounds, calls=args.calls)
        print(
            f"{size!s:<40} {result.eager_us:>10.1f} {result.replay_us:>10.1f} "
            f"{result.ratio:>12.2f}x"
        )


if __name__ == "__main__":
    main()
