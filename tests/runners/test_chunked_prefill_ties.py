"""A prompt gives the same tokens and logits whatever the step's token budget, alone or batched,
in float32 and bfloat16, on a model whose indexer ties at the cut in most rows.

The model: the tiny preset with one indexer head, ``index_topk=2`` and the ``one-head``
indexer weights (``dsv4.testing.INDEXER_WEIGHTS``), so an entry scores exactly 0.0 wherever
that head's ReLU is zero. Budgets of 3, 16 and 64 tokens cut the 70-token prompt into chunks
that end at every phase of the rate-4 compression and give each step a different context width
(the width the indexer's top-k runs over). With ``torch.topk`` the logits at the prompt's last
token differ between budgets by 0.009-0.074 in float32 and 0.016-0.07 in bfloat16 (ties broken
differently at different widths); with the tie rule not at all, in either dtype. That needs
every product to sum in one order at every row count: float32 products go in panels at every
row count, whose sums depend on neither the row count nor the rows beside them (MKL's did, by
up to 1.2e-6; the dot kernel that chunks of at most four rows took before, ``SKINNY_ROWS``,
summed in another order: budgets 1-4, whose chunks all have at most four rows, then gave
logits 2.0e-6 from budget 5's, and so did budget 6, whose last chunk has four). Budget 3's
chunks are all of three rows or fewer, the others' of more. The cheap version of
``tests.runners.long_prompt`` (5,083 tokens at budgets 64, 256 and 2,048: bit for bit the same
logits in both dtypes).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from dsv4.config import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.testing import random_model
from runners.engine import SamplingParams
from runners.spec import EngineSpec, build_engine

BUDGETS = (3, 16, 64)
PROMPT = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
OTHER = PROMPT[:23][::-1]
"""A second request for the batched runs (shorter, so the two end prefill in different steps)."""
NEW_TOKENS = 3


def build_tying_model() -> DeepseekV4ForCausalLM:
    """The tie-heavy model (also run under every instruction set by ``tests/dsv4/isa_run``)."""
    config = attrs.evolve(DeepseekV4Config.tiny(), index_n_heads=1, index_topk=2)
    return random_model(config, 3, indexer="one-head")


@pytest.fixture(scope="module")
def tying_model() -> DeepseekV4ForCausalLM:
    return build_tying_model()


def in_dtype(model: DeepseekV4ForCausalLM, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
    if dtype == torch.float32:
        return model
    converted = DeepseekV4ForCausalLM(model.config, dtype=dtype)  # fp32-kept modules stay so
    converted.load_state_dict(model.state_dict())
    return converted.eval()


def run_budget(
    model: DeepseekV4ForCausalLM, budget: int, prompts: list[list[int]]
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Greedy tokens of every prompt, and the logits at the first prompt's last token."""
    length = len(prompts[0])
    engine = build_engine(
        EngineSpec(
            platform="cpu",
            cudagraph_mode="NONE",
            max_num_tokens=budget,
            capture_sizes=tuple(size for size in (1, 2, 4) if size <= budget),
            max_model_len=max(map(len, prompts)) + NEW_TOKENS,
        ),
        model=model,
    )
    last: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(chunks, token_ids):  # type: ignore[no-untyped-def]
        logits = execute(chunks, token_ids)
        for index, chunk in enumerate(chunks):
            if chunk.row == 0 and chunk.start_position + chunk.num_tokens == length:
                last.append(logits[index].clone())
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    outputs = engine.llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    return [tuple(o.output_ids) for o in outputs], last[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_budget_gives_the_same_tokens_and_logits_alone_and_batched(
    tying_model: DeepseekV4ForCausalLM, dtype: torch.dtype
) -> None:
    model = in_dtype(tying_model, dtype)
    alone = [run_budget(model, budget, [PROMPT]) for budget in BUDGETS]
    batched = [run_budget(model, budget, [PROMPT, OTHER]) for budget in BUDGETS]
    for tokens, logits in alone[1:] + batched:
        assert tokens[0] == alone[0][0][0]
        assert torch.equal(logits, alone[0][1])
    for tokens, _ in batched[1:]:
        assert tokens == batched[0][0]
