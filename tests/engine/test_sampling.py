"""Sampling against a hand-written float64 reference of the filtering rules, plus greedy ties,
batch invariance, seeds, the empirical distribution of draws, and rows that fail alone."""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from runners.engine import SamplingParams
from runners.engine.sampling import NON_FINITE_LOGITS, filtered_probs, sample, seeded_generator

# Logits on a grid of quarters and power-of-two temperatures divide exactly in float32 and
# float64, so ties are exact (and frequent) in both and the two implementations see one order.
grid_logits = st.lists(st.integers(-12, 12).map(lambda q: q / 4), min_size=1, max_size=12)
temperatures = st.sampled_from([0.5, 1.0, 2.0, 4.0])


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """The documented rules, one token at a time in float64."""
    scaled = [x / temperature for x in logits]
    ordered = sorted(scaled, reverse=True)
    kth = ordered[min(top_k, len(ordered)) - 1] if top_k > 0 else ordered[-1]
    candidates = [s for s in ordered if s >= kth]
    weights = [math.exp(s - candidates[0]) for s in candidates]
    total = sum(weights)
    threshold = candidates[-1]
    if top_p < 1.0:
        mass = 0.0
        for s, w in zip(candidates, weights, strict=True):
            assume(abs(mass - top_p) > 1e-5)
            if mass >= top_p:
                break
            threshold = s
            mass += w / total
    kept = [math.exp(s - ordered[0]) if s >= threshold else 0.0 for s in scaled]
    norm = sum(kept)
    return [k / norm for k in kept]


@given(
    grid_logits,
    temperatures,
    st.integers(0, 14),
    st.floats(0.01, 1.0),
)
def test_filtered_probs_follow_the_documented_rules(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    got = filtered_probs(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )[0]
    want = torch.tensor(reference_probs(logits, temperature, top_k, top_p), dtype=torch.float32)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_ties_at_the_boundary_are_kept_together() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    one = torch.tensor([1.0])
    top2 = filtered_probs(logits, one, torch.tensor([2]), one)
    top3 = filtered_probs(logits, one, torch.tensor([3]), one)
    assert (top2[0] > 0).tolist() == [False, True, False, True, False, False]
    assert (top3[0] > 0).tolist() == [False, True, True, True, True, False]
    nucleus = filtered_probs(logits, one, torch.tensor([0]), torch.tensor([0.5]))
    assert (nucleus[0] > 0).tolist() == [False, True, False, True, False, False]
    # Top-p sees the tied tokens top-k kept: e^3 / (e^3 + 2 e^2) = 0.576 < 0.6, so the 2s stay
    # (counting only one of them, 0.731 >= 0.6, would keep the 3 alone).
    both = filtered_probs(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), one, torch.tensor([2]), 0.6 * one)
    assert (both[0] > 0).tolist() == [True, True, True, False]


@given(
    st.lists(
        st.tuples(grid_logits.filter(lambda x: len(x) == 6), temperatures), min_size=1, max_size=5
    ),
    st.lists(st.integers(0, 7), min_size=5, max_size=5),
    st.lists(st.floats(0.05, 1.0), min_size=5, max_size=5),
)
def test_filtering_is_row_wise(
    rows: list[tuple[list[float], float]], top_k: list[int], top_p: list[float]
) -> None:
    n = len(rows)
    logits = torch.tensor([r[0] for r in rows])
    temperature = torch.tensor([r[1] for r in rows])
    k, p = torch.tensor(top_k[:n]), torch.tensor(top_p[:n])
    batched = filtered_probs(logits, temperature, k, p)
    for i in range(n):
        alone = filtered_probs(
            logits[i : i + 1], temperature[i : i + 1], k[i : i + 1], p[i : i + 1]
        )
        assert torch.equal(batched[i : i + 1], alone)


def test_greedy_takes_the_first_maximum() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


@given(
    st.lists(st.integers(-40, 40).map(lambda q: q / 4), min_size=2, max_size=20, unique=True),
    st.integers(0, 2**32),
)
def test_top_k_one_is_greedy_whatever_the_seed(logits: list[float], seed: int) -> None:
    row = torch.tensor([logits])
    params = SamplingParams(temperature=1.5, top_k=1, seed=seed)
    (token,) = sample(row, [params], [seeded_generator(seed, row.device)])
    assert token == int(row.argmax())


def test_a_seed_reproduces_wherever_the_row_sits() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, generator=generator)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    others = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=7)]

    def draws(position: int) -> list[int]:
        mine = seeded_generator(42, logits.device)
        tokens = []
        for _ in range(10):
            params = [*others]
            params.insert(position, seeded)
            gens = [None, seeded_generator(7, logits.device)]
            gens.insert(position, mine)
            rows = torch.cat([logits[:position], logits[3:4], logits[position:2]])
            tokens.append(sample(rows, params, gens)[position])
        return tokens

    runs = [draws(position) for position in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    want = filtered_probs(
        logits[None], torch.tensor([0.8]), torch.tensor([5]), torch.tensor([0.9])
    )[0]
    torch.manual_seed(0)
    n = 3000
    tokens = sample(logits.expand(n, -1), [params] * n, [None] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / n
    assert counts[want == 0].sum() == 0
    torch.testing.assert_close(counts, want, atol=0.035, rtol=0)


@given(
    st.lists(st.sampled_from(["ok", "nan", "inf", "-inf", "overflow"]), min_size=1, max_size=6),
    st.integers(0, 2**32),
)
def test_rows_that_cannot_be_sampled_fail_alone(kinds: list[str], seed: int) -> None:
    """A failed row gets its reason; every other row gets the token it gets without it."""
    logits = torch.randn(len(kinds), 24, generator=torch.Generator().manual_seed(seed)) * 3
    params: list[SamplingParams] = []
    for i, kind in enumerate(kinds):
        if kind in ("nan", "inf", "-inf"):
            logits[i, (seed + i) % 24] = float(kind)
        tiny = kind == "overflow"
        temperature = 1e-45 if tiny else [0.0, 0.7, 1.3][(seed + i) % 3]
        params.append(SamplingParams(temperature=temperature, top_p=0.9, seed=seed + i))

    def generators() -> list[torch.Generator]:
        return [seeded_generator(seed + i, logits.device) for i in range(len(kinds))]

    got = sample(logits, params, generators())
    alone = [
        sample(logits[i : i + 1], params[i : i + 1], generators()[i : i + 1])[0]
        for i in range(len(kinds))
    ]
    assert got == alone
    for kind, result, p in zip(kinds, got, params, strict=True):
        if kind == "ok":
            assert isinstance(result, int)
        elif kind == "overflow":
            assert result == (
                f"its logits divided by temperature {p.temperature:g} overflow float32 "
                "(non-finite probabilities); use a larger temperature"
            )
        else:
            assert result == NON_FINITE_LOGITS


def test_filtering_an_overflowed_row_keeps_a_token_instead_of_raising() -> None:
    """Scaled logits of inf used to cut every token with top_p < 1 (gather at index -1)."""
    probs = filtered_probs(
        torch.tensor([[1.0, 2.0, 3.0]]),
        torch.tensor([1e-45]),
        torch.tensor([0]),
        torch.tensor([0.5]),
    )
    assert probs.shape == (1, 3)


@given(grid_logits, temperatures, st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]), st.integers(0, 14))
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best(
    logits: list[float], temperature: float, min_p: float, top_k: int
) -> None:
    """Min-p first (on the tempered distribution), then top-k among the survivors."""
    scaled = [x / temperature for x in logits]
    best = max(math.exp(s) for s in scaled)
    survivors = [s for s in scaled if math.exp(s) >= min_p * best]
    assume(all(abs(math.exp(s) - min_p * best) > 1e-6 * best for s in scaled))
    kth = sorted(scaled, reverse=True)[min(top_k, len(scaled)) - 1] if top_k > 0 else -math.inf
    kept = [s >= max(kth, min(survivors)) for s in scaled]
    got = filtered_probs(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([1.0]),
        torch.tensor([min_p]),
    )[0]
    assert (got > 0).tolist() == kept
    weights = [math.exp(s) if k else 0.0 for s, k in zip(scaled, kept, strict=True)]
    want = torch.tensor([w / sum(weights) for w in weights], dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
