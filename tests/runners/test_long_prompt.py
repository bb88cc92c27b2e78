"""``tests.runners.long_prompt`` at a few hundred tokens: every budget gives the same tokens and
logits in both dtypes, and a budget that disagreed would be named."""

from __future__ import annotations

import torch

from tests.runners.long_prompt import BudgetRun, disagreeing, run


def test_a_long_prompt_gives_the_same_tokens_and_logits_at_every_budget() -> None:
    runs = run(300, (64, 256), (torch.bfloat16, torch.float32))
    assert [(r.dtype, r.budget) for r in runs] == [
        ("bfloat16", 64),
        ("bfloat16", 256),
        ("float32", 64),
        ("float32", 256),
    ]
    assert disagreeing(runs) == []
    assert runs[0].digest != runs[2].digest  # the digest tells the dtypes' logits apart


def test_chunks_of_four_rows_or_fewer_give_the_same_logits_as_wider_ones() -> None:
    """99 tokens at budgets 5, 16 and 64 end in chunks of 4, 3 and 35 rows: a chunk of at most
    four rows once took the dot kernel (``SKINNY_ROWS``), whose sums are in another order than
    the panels', and the last-token logits were 1.5e-6 and 4.4e-6 apart in float32."""
    runs = run(99, (5, 16, 64), (torch.bfloat16, torch.float32))
    assert len(runs) == 6 and disagreeing(runs) == []


def test_a_budget_that_disagrees_within_its_dtype_is_named() -> None:
    def one(dtype: str, budget: int, tokens: tuple[int, ...], digest: str) -> BudgetRun:
        return BudgetRun(dtype, budget, tokens, digest, 0.0)

    agreeing = [one("bfloat16", 64, (1, 2), "a"), one("float32", 64, (1, 3), "b")]
    assert disagreeing(agreeing) == []
    other_tokens = one("bfloat16", 256, (1, 4), "a")
    other_logits = one("float32", 256, (1, 3), "c")
    assert disagreeing([*agreeing, other_tokens, other_logits]) == [other_tokens, other_logits]
