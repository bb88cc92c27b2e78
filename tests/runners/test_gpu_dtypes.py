"""On a GPU: CUDA graphs generate the eager tokens, logits within the project's tolerance for the
device and dtype (``equality_tolerance``: bfloat16 5e-2), in bfloat16 and with FP8 weights held
weight-only (dequantized inside every matmul, captured into the graphs with the rest).

Behind the ``cuda`` marker: skipped, with its reason, where no GPU is available."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.quant_layers import QuantizedExperts, QuantizedLinear
from dsv4.quantized_writer import save_random_quantized_checkpoint
from platforms import CudaPlatform, Platform, RocmPlatform
from runners import EngineSpec, SamplingParams
from runners.measure.equivalence import Status, judge, run_trace
from runners.spec import build_model

pytestmark = pytest.mark.cuda

PROMPTS = ((7, 3, 11, 5, 2), tuple(range(40, 53)))
GREEDY = SamplingParams(max_tokens=6)


def _gpu() -> Platform:
    return CudaPlatform() if torch.version.hip is None else RocmPlatform()


def _graphs_equal_eager(spec: EngineSpec, model: DeepseekV4ForCausalLM) -> None:
    """``spec`` with its resolved graphs against ``model`` (built for ``spec``) run eagerly:
    one model, loaded once, shared by both engines; prefill chunks of up to 8 tokens."""
    graphs, eager = (
        run_trace(s, model, PROMPTS, GREEDY, max_num_batched_tokens=8)
        for s in (spec, attrs.evolve(spec, cudagraph_mode="NONE"))
    )
    assert graphs.num_graphs > 0
    verdict = judge(graphs, eager)
    assert verdict.status is Status.EQUAL, verdict.detail


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_bfloat16_cuda_graphs_generate_the_eager_tokens(runner: str) -> None:
    spec = EngineSpec(platform=_gpu(), dtype="bfloat16", runner=runner, capture_sizes=(1, 2, 4))
    _graphs_equal_eager(spec, build_model(spec))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_weight_only_cuda_graphs_generate_the_eager_tokens(tmp_path: Path, dtype: str) -> None:
    checkpoint = save_random_quantized_checkpoint(
        tmp_path, DeepseekV4Config.tiny(), 1, expert_dtype="fp8"
    )
    spec = EngineSpec(
        platform=_gpu(),
        checkpoint=checkpoint,
        quantization="weight-only",
        dtype=dtype,
        capture_sizes=(1, 2, 4),
    )
    model = build_model(spec)
    held = {type(m) for m in model.modules()}
    assert QuantizedLinear in held and QuantizedExperts in held  # the bytes stay resident
    _graphs_equal_eager(spec, model)
