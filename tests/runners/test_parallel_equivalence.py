"""The cross-strategy property at a tensor-parallel size of 2: every configuration the (runner,
graph mode) pairs resolve to, run on two local ranks (``launch_engine``), generates the greedy
tokens of one rank's eager runner, with every step's logits within the CPU float32 tolerance.

The batches are ``test_runner_equivalence``'s (drawn prompts, chunked prefill under a small token
budget, padded and eager steps, replayed decode graphs), and so are the engine's sizes. At this
size the CPU's gloo collectives cannot be captured, so each one is an eager break and FULL
graphs are downgraded to PIECEWISE; the ten pairs therefore resolve to six configurations
(``test_the_pairs_resolve_at_two_ranks_without_full_graphs``), each launched and tested once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runners import CUDAGraphMode, EngineSpec, RankedEngine, Resolution, launch_engine
from tests.runners.support import (
    CAPTURE_SIZES,
    FIRST_CONTEXT_BUCKET,
    LAYOUT,
    MAX_NUM_TOKENS,
    MIXED_BATCH,
    greedy,
    max_logit_difference,
    prompts,
    resolve_on,
)
from tests.runners.test_runner_equivalence import PAIRS, eager

SIZE = 2
ATOL = 5e-5
"""DESIGN's CPU float32 tolerance: the ranks' partial sums are added in another order."""


def _key(resolution: Resolution) -> tuple[object, ...]:
    return (
        resolution.runner.name,
        resolution.decode_mode,
        resolution.mixed_mode,
        resolution.eager_region.name,
    )


class _Launched:
    """One launched engine at a time (each holds two rank processes): the one for the current
    configuration; the previous one is closed when another is asked for."""

    def __init__(self) -> None:
        self.key: tuple[object, ...] | None = None
        self.engine: RankedEngine | None = None

    def get(self, runner: str, mode: CUDAGraphMode) -> RankedEngine:
        key = _key(resolve_on(runner=runner, mode=mode, tensor_parallel_size=SIZE))
        if self.engine is None or key != self.key:
            self.close()
            spec = EngineSpec(
                platform="cpu",
                runner=runner,
                cudagraph_mode=mode.name,
                tensor_parallel_size=SIZE,
                layout=LAYOUT,
                capture_sizes=CAPTURE_SIZES,
                max_num_tokens=MAX_NUM_TOKENS,
                first_context_bucket=FIRST_CONTEXT_BUCKET,
            )
            self.key, self.engine = key, launch_engine(spec)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


_launched = _Launched()


@pytest.fixture(scope="module", autouse=True)
def _close_the_last_engine() -> Iterator[None]:
    yield
    _launched.close()


def _resolved(pair: tuple[str, CUDAGraphMode]) -> str:
    runner, mode = pair
    return str(_key(resolve_on(runner=runner, mode=mode, tensor_parallel_size=SIZE)))


DISTINCT = sorted({_resolved(pair): pair for pair in PAIRS}.values(), key=_resolved)
"""One pair per configuration they resolve to at two ranks (pairs that resolve alike run the
very same engine on the same batches), each launched once."""


@pytest.mark.parametrize(("runner", "mode"), DISTINCT, ids=[f"{r}-{m.name}" for r, m in DISTINCT])
@settings(max_examples=2)
@given(batch=prompts, max_tokens=st.integers(2, 6))
@example(batch=MIXED_BATCH, max_tokens=6)
def test_pair_on_two_ranks_generates_the_eager_tokens_of_one(
    runner: str, mode: CUDAGraphMode, batch: list[list[int]], max_tokens: int
) -> None:
    engine = _launched.get(runner, mode)
    reference = eager(batch, max_tokens)
    got = greedy(engine.ranks, batch, max_tokens)
    assert got.tokens == reference.tokens
    assert max_logit_difference(got, reference) <= ATOL
    captured_modes = {key.mode for key in engine.ranks.captured}
    resolved_modes = {engine.resolution.decode_mode, engine.resolution.mixed_mode}
    assert captured_modes <= resolved_modes - {CUDAGraphMode.NONE}


def test_the_pairs_resolve_at_two_ranks_without_full_graphs() -> None:
    """Alone, V2 gets FULL decode graphs; at two ranks on the CPU each is downgraded to
    PIECEWISE (in the narrow region its breaks need), and nothing else changes."""
    seen = {
        _key(resolve_on(runner=runner, mode=mode, tensor_parallel_size=SIZE))
        for runner, mode in PAIRS
    }
    none, piecewise = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE
    assert seen == {
        ("v1", none, none, "no-graph"),
        ("v1", piecewise, piecewise, "wide"),
        ("v1", piecewise, none, "wide"),
        ("v2", none, none, "no-graph"),
        ("v2", piecewise, piecewise, "narrow"),
        ("v2", piecewise, none, "narrow"),
    }
