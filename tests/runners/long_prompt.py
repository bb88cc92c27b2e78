"""The tie suite at length: one long prompt at several token budgets, on ``small`` with four
indexer heads of ``one-head`` weights (so the indexer ties at the cut in most rows), in
float32 and bfloat16, on one thread. Every budget must give the same greedy tokens and the
same bits of the logits at the prompt's last token; the digest of those logits lets runs under
different ``DSV4_KERNEL_ISA`` values be compared by eye::

    DSV4_KERNEL_ISA=avx2 python -m tests.runners.long_prompt

prints one line per dtype and budget and exits 1 when some budget disagrees within a dtype.
``test_long_prompt`` runs it at 300 tokens; the 5,083-token default takes
about 20 s on AVX-512, 50 s on AVX2 and over ten minutes on baseline (docs/testing.md).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import dsv4_isa

ISA = dsv4_isa.apply_requested()  # before torch's libraries first run: it caps them

import attrs  # noqa: E402
import torch  # noqa: E402

from dsv4.config import DeepseekV4Config  # noqa: E402
from dsv4.model import DeepseekV4ForCausalLM  # noqa: E402
from dsv4.testing import random_model  # noqa: E402
from tests.runners.test_chunked_prefill_ties import in_dtype, run_budget  # noqa: E402


@attrs.frozen
class BudgetRun:
    """One budget's greedy tokens, its last-token logits' digest, and how long it took."""

    dtype: str
    budget: int
    tokens: tuple[int, ...]
    digest: str
    seconds: float

    def line(self) -> str:
        tokens = list(self.tokens)
        return f"{self.dtype:8} budget {self.budget:5}: {tokens} {self.digest} {self.seconds:.2f}s"


def long_prompt_model() -> DeepseekV4ForCausalLM:
    """``small`` with four indexer heads, only the first weighted; always the same weights."""
    config = attrs.evolve(DeepseekV4Config.small(), index_n_heads=4)
    return random_model(config, 3, indexer="one-head")


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(3)).tolist()


def digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()[:12]


def run(length: int, budgets: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> list[BudgetRun]:
    """Every (dtype, budget) run of the ``length``-token prompt, in that order, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = long_prompt_model()
        tokens_in = [prompt(length)]
        runs = []
        for dtype in dtypes:
            converted = in_dtype(model, dtype)
            for budget in budgets:
                start = time.perf_counter()
                tokens, logits = run_budget(converted, budget, tokens_in)
                seconds = time.perf_counter() - start
                name = str(dtype).removeprefix("torch.")
                runs.append(BudgetRun(name, budget, tokens[0], digest(logits), seconds))
        return runs
    finally:
        torch.set_num_threads(threads)


def disagreeing(runs: list[BudgetRun]) -> list[BudgetRun]:
    """The runs whose tokens or logits differ from their dtype's first run."""
    first: dict[str, BudgetRun] = {}
    for one in runs:
        first.setdefault(one.dtype, one)
    return [
        one
        for one in runs
        if (one.tokens, one.digest) != (first[one.dtype].tokens, first[one.dtype].digest)
    ]


def budget_list(text: str) -> tuple[int, ...]:
    """``--budgets``: positive integers, comma-separated."""
    try:
        budgets = tuple(int(b) for b in text.split(","))
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"not positive integers, comma-separated: {text!r}")
    return budgets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.runners.long_prompt", description=__doc__
    )
    parser.add_argument("--tokens", type=int, default=5083, help="prompt length (default 5083)")
    parser.add_argument(
        "--budgets",
        type=budget_list,
        default=(64, 256, 2048),
        help="token budgets, comma-separated (default 64,256,2048)",
    )
    args = parser.parse_args(argv)
    print(f"isa {ISA or torch.backends.cpu.get_cpu_capability()}, {args.tokens} tokens", flush=True)
    runs = run(args.tokens, args.budgets, (torch.bfloat16, torch.float32))
    for one in runs:
        print(one.line())
    wrong = disagreeing(runs)
    for one in wrong:
        print(
            f"differs from its dtype's first budget: {one.dtype} budget {one.budget}",
            file=sys.stderr,
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
