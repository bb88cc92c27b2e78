"""Our model equals transformers 5.23.0 (the oracle) on random tiny configs, cached or not.

The drawn models tie on purpose (few indexer heads, zeroed indexer head weights, routers whose
experts all score alike), and the oracle is tie-aware (``tests.dsv4.hf_ties``): where equal
scores straddle a top-k cut it takes our rule, the lower index, having checked that only tied
entries differ from ``torch.topk``'s choice."""

from __future__ import annotations

import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.config import DeepseekV4Config
from dsv4.testing import (
    chunk_schedule,
    chunk_sizes,
    configs,
    indexer_weights,
    prompts,
    random_model,
    router_weights,
    run_schedule,
)
from tests.dsv4.hf_ties import tie_aware
from tests.dsv4.support import hf_logits, hf_twin, max_diff

TOLERANCE = 1e-4


@settings(max_examples=40)
@given(
    config=configs(),
    batch=st.lists(prompts(), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 3, 4, 8]),
    indexer=indexer_weights,
    router=router_weights,
)
def test_batched_prefill_equals_hf(
    config: DeepseekV4Config,
    batch: list[list[int]],
    seed: int,
    block_size: int,
    indexer: str,
    router: str,
) -> None:
    """One step holding every prompt whole gives the reference logits of each prompt."""
    model = random_model(config, seed, indexer=indexer, router=router)
    hf = hf_twin(model)
    expected = [hf_logits(hf, p) for p in batch]
    ours = run_schedule(
        model, batch, chunk_schedule([[len(p)] for p in batch]), block_size=block_size, seed=seed
    )
    assert max_diff(ours, expected) <= TOLERANCE


@st.composite
def cached_cases(draw: st.DrawFn) -> tuple[DeepseekV4Config, list[list[int]], list[list[int]]]:
    """A config, prompts and, per prompt, a chunking: random chunks, all-ones (decode) or mixed."""
    config = draw(configs(max_layers=2))
    batch = draw(st.lists(prompts(max_len=40), min_size=1, max_size=3))
    chunkings = []
    for prompt in batch:
        style = draw(st.sampled_from(["chunks", "decode", "prefill-then-decode"]))
        if style == "chunks":
            sizes = draw(chunk_sizes(len(prompt), 9))
        elif style == "decode":
            sizes = [1] * len(prompt)
        else:
            head = draw(st.integers(1, len(prompt)))
            sizes = [head] + [1] * (len(prompt) - head)
        chunkings.append(sizes)
    return config, batch, chunkings


@settings(max_examples=40)
@given(
    case=cached_cases(),
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 5]),
    pad=st.sampled_from([1, 4]),
    indexer=indexer_weights,
)
def test_cached_paths_equal_hf_uncached(
    case: tuple[DeepseekV4Config, list[list[int]], list[list[int]]],
    seed: int,
    block_size: int,
    pad: int,
    indexer: str,
) -> None:
    """Chunked prefill, token-by-token decode and requests at different positions in one batch
    (with padded batches) all give the reference's uncached logits."""
    config, batch, chunkings = case
    model = random_model(config, seed, indexer=indexer)
    hf = hf_twin(model)
    expected = [hf_logits(hf, p) for p in batch]
    ours = run_schedule(
        model,
        batch,
        chunk_schedule(chunkings),
        block_size=block_size,
        pad_to_multiple=pad,
        seed=seed,
    )
    assert max_diff(ours, expected) <= TOLERANCE


def test_tiny_preset_equals_hf_over_long_prompts() -> None:
    """The built-in preset over prompts long enough to fill many HCA windows and CSA top-k."""
    config = DeepseekV4Config.tiny()
    model = random_model(config, 7)
    hf = hf_twin(model)
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (70, 33, 9)]
    chunkings = [[16, 16, 16, 16, 6], [1] * 33, [9]]
    expected = [hf_logits(hf, p) for p in batch]
    ours = run_schedule(model, batch, chunk_schedule(chunkings), block_size=16, pad_to_multiple=8)
    assert max_diff(ours, expected) <= TOLERANCE


def test_where_ties_decide_transformers_is_followed_only_among_equal_scores() -> None:
    """Every indexer score 0.0 and every expert scoring alike: the tie rule alone chooses. The
    tie-aware oracle took our rule in rows where ``torch.topk`` chose other, equally scored
    entries or experts, and we equal it; transformers left to its ``torch.topk`` differs."""
    model = random_model(DeepseekV4Config.tiny(), 1, indexer="zero", router="equal")
    prompt = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = run_schedule(model, [prompt], chunk_schedule([[60]]), block_size=16)[0]
    hf = hf_twin(model)
    assert max_diff([ours], [hf_logits(hf, prompt)]) <= TOLERANCE
    assert tie_aware(hf).decided > 0
    own_choice = transformers.DeepseekV4ForCausalLM(hf.config).eval()
    own_choice.load_state_dict(model.state_dict())
    with torch.no_grad():
        theirs = own_choice(torch.tensor([prompt]), use_cache=False).logits[0]
    assert max_diff([ours], [theirs]) > 100 * TOLERANCE
