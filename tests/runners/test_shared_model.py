"""Runners over one shared model run in turn: building a runner changes nothing in the model.

Each runner owns its paged caches and its eager region and hands both to the model, with the
step's metadata, in every forward context. So two engines with different regions over the same
model — one capturing its input preparation (V2, narrow), one running it eagerly (V1, wide),
both captured before either runs — interleave their ``generate`` calls, and each generates what
its own eager reference does, with the same logits.
"""

from __future__ import annotations

from graphs import NarrowRegion, WideRegion
from runners import CUDAGraphMode
from tests.runners.support import (
    MIXED_BATCH,
    fresh_model,
    greedy,
    max_logit_difference,
    resolve_on,
    tiny_runner,
)

BATCHES = [MIXED_BATCH, [[5, 6, 7, 8, 9], list(range(100, 111))]]


def test_two_engines_over_one_model_run_in_turn() -> None:
    model = fresh_model()
    narrow = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"), model=model)
    narrow.capture()
    wide = tiny_runner(resolve_on(runner="v1", mode="PIECEWISE"), model=model)
    wide.capture()
    assert (narrow.eager_region, wide.eager_region) == (NarrowRegion(), WideRegion())
    assert narrow.kv_caches is not wide.kv_caches
    references = {
        runner: tiny_runner(resolve_on(runner=runner, mode=CUDAGraphMode.NONE))
        for runner in ("v1", "v2")
    }
    for batch in BATCHES * 2:
        for runner, name in ((narrow, "v2"), (wide, "v1")):
            got, expected = greedy(runner, batch, 5), greedy(references[name], batch, 5)
            assert got.tokens == expected.tokens
            assert max_logit_difference(got, expected) <= 1e-5
    assert narrow.audit_findings == () and wide.audit_findings == ()
