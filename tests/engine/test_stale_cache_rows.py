"""What a request leaves in the cache never reaches a later request, NaN included.

Token 300 of the built-in model embeds to 3e38 here, so a prompt of it fills every row it writes,
window and compressed entries alike, with NaN, and fails (``FinishReason.ERROR``). Its blocks go
back to the pool and the next, shorter request takes them (last in, first out). That request
reads rows of those blocks that it has not written yet — compressed entries it cannot see yet,
at weight zero — and 0 * NaN is NaN: before the attention zeroed the keys of unseen entries, it
failed too. Now it generates exactly what it generates on a fresh engine.
"""

from __future__ import annotations

import pytest
import torch

from runners.engine import FinishReason, RequestFailedError, SamplingParams
from runners.spec import Engine, EngineSpec, build_engine

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 256 for i in range(20)]


def _engine(mode: str) -> Engine:
    engine = build_engine(
        EngineSpec(cudagraph_mode=mode, max_model_len=128, max_num_seqs=2, capture_sizes=(1, 2))
    )
    with torch.no_grad():
        engine.runner.model.model.embed_tokens.weight[300] = 3e38
    return engine


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_a_failed_requests_nan_rows_never_reach_the_next_request(mode: str) -> None:
    expected = _engine(mode).llm.generate([PROMPT], PARAMS)[0].output_ids
    engine = _engine(mode)
    with pytest.raises(RequestFailedError) as failed:
        engine.llm.generate([[300] * 60], PARAMS)
    assert failed.value.outputs[0].finish_reason is FinishReason.ERROR
    entries = [t for layer in engine.runner.kv_caches.layers for t in layer.entry_tensors()]
    assert any(t.isnan().any() for t in entries)  # the failed request left NaN entries
    output = engine.llm.generate([PROMPT], PARAMS)[0]
    assert output.finish_reason is FinishReason.LENGTH
    assert output.output_ids == expected
