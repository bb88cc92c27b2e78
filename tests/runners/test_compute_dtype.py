"""The engine in every compute dtype: as close to float32 as transformers is, caches in the
compute dtype, every graph mode equal to eager, the capture audit still catching the seed's bug,
and dtypes a platform cannot compute in refused before anything is loaded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from dsv4 import DeepseekV4Config, save_random_checkpoint
from platforms import CpuPlatform, CudaPlatform, simulate
from runners.engine.executor import ScheduledChunk
from runners.errors import UnsupportedDtypeError
from runners.measure.equivalence import equality_tolerance
from runners.measure.matrix import MatrixOptions, run_matrix
from runners.spec import EngineSpec, build_engine, build_model
from tests.dsv4.support import hf_logits

FAST = {"platform": "cpu", "capture_sizes": (1, 2, 4)}


def _checkpoint(directory: Path, seed: int) -> Path:
    return save_random_checkpoint(directory, DeepseekV4Config.tiny(), seed=seed)


def _engine_logits(checkpoint: Path, dtype: str, prompt: list[int]) -> torch.Tensor:
    """The engine's logits ``[len(prompt), vocab]``, teacher-forced one token per step (so
    every position's logits come from a replayed FULL decode graph)."""
    runner = build_engine(EngineSpec(checkpoint=checkpoint, dtype=dtype, **FAST)).runner
    blocks = tuple(range(math.ceil(len(prompt) / runner.layout.block_size)))
    return torch.cat(
        [
            runner.execute(
                [ScheduledChunk(row=0, block_ids=blocks, start_position=t, num_tokens=1)], [[token]]
            )
            for t, token in enumerate(prompt)
        ]
    )


def _hf(checkpoint: Path, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    return hf_logits(model.eval(), prompt)


@pytest.mark.parametrize("seed", [1, 3, 5])
def test_bfloat16_engine_is_as_close_to_float32_as_transformers_bfloat16(
    tmp_path: Path, seed: int
) -> None:
    """Per position, the largest logit error against transformers' float32 logits: ours in
    bfloat16 has a median and a maximum within 1.5x of transformers' own bfloat16 ones (both
    pay for the same rounding, and both round where the other does)."""
    checkpoint = _checkpoint(tmp_path, seed)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = _hf(checkpoint, torch.float32, prompt)
    theirs = (_hf(checkpoint, torch.bfloat16, prompt) - reference).abs().amax(-1)
    ours = (_engine_logits(checkpoint, "bfloat16", prompt) - reference).abs().amax(-1)
    assert float(ours.median()) <= 1.5 * float(theirs.median())
    assert float(ours.max()) <= 1.5 * float(theirs.max())
    assert float(theirs.median()) > 1e-3  # the comparison is about real rounding, not noise
    # float16 (which transformers 5.23.0 cannot run: see dsv4.dtypes) has 3 more mantissa bits
    half = (_engine_logits(checkpoint, "float16", prompt) - reference).abs().amax(-1)
    assert float(half.median()) <= float(theirs.median()) / 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kv_caches_follow_the_compute_dtype(dtype: str) -> None:
    engine = build_engine(EngineSpec(dtype=dtype, **FAST))
    model = engine.runner.model
    expected = getattr(torch, dtype)
    assert model.compute_dtype == expected
    assert any(p.dtype == torch.float32 for p in model.parameters())  # the fp32-kept ones
    for layer in engine.runner.kv_caches.layers:
        assert layer.kv.dtype == expected
        for part in (layer.compressor, layer.indexer):
            if part is not None:
                assert part.kv.dtype == part.entries.dtype == expected
                assert part.gate.dtype == torch.float32  # holds the fp32 position bias


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_runner_region_and_mode_equals_eager(dtype: str) -> None:
    """Capture, replay and the audit in half precision: every allowed cell of the matrix equals
    its eager run within ``equality_tolerance("cpu", dtype)``; V1 with a region narrower than
    wide still fails the capture audit (the seed's bug), exactly as in float32."""
    options = MatrixOptions(
        platforms=("cpu",),
        dtype=dtype,
        max_new_tokens=6,
        unsafe_region=True,
        capture_sizes=(1, 2, 4),  # decode batches of 3 pad to 4; longer chunks run eager
    )
    payload = run_matrix(options, lambda line: None)
    assert payload["dtype"] == dtype
    (reference,) = payload["references"]
    assert reference["dtype"] == dtype
    assert reference["atol"] == equality_tolerance("cpu", getattr(torch, dtype))
    statuses = {(c["runner"], c["eager_region"], c["cudagraph_mode"]): c for c in payload["cells"]}
    assert payload["counts"] == {"equal": 32, "audit-error": 8}
    assert all(
        cell["status"] == "audit-error"
        for (runner, region, mode), cell in statuses.items()
        if runner == "v1" and region in ("full-graph", "narrow") and mode != "NONE"
    )


class _NoHalfCpu(CpuPlatform):
    """A CPU whose device part cannot compute in float16 (as a plugin platform might)."""

    name = "cpu-no-half"

    def unsupported_dtype_reason(self, dtype: torch.dtype) -> str | None:
        return "no float16 kernels on this device" if dtype == torch.float16 else None


def test_a_dtype_the_platform_cannot_compute_in_is_refused_before_loading() -> None:
    spec = EngineSpec(platform=_NoHalfCpu(), dtype="float16", checkpoint=Path("/nonexistent"))
    with pytest.raises(UnsupportedDtypeError, match="cannot compute in float16: no float16"):
        build_engine(spec)  # refused before the (missing) checkpoint is read
    model = build_model(EngineSpec(dtype="float16"))
    with pytest.raises(UnsupportedDtypeError, match="--dtype float32\\|bfloat16\\|float16"):
        build_engine(EngineSpec(platform=_NoHalfCpu()), model=model)  # the model's dtype counts
    assert build_engine(EngineSpec(platform=_NoHalfCpu(), dtype="bfloat16", capture_sizes=(1,)))
    # a simulated platform computes on the CPU, so it answers as the CPU does
    assert simulate(_NoHalfCpu()).unsupported_dtype_reason(torch.float16) is None
    assert CpuPlatform().unsupported_dtype_reason(torch.float16) is None


def test_an_unknown_dtype_name_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineSpec(dtype="float64")


def test_a_gpu_without_native_bfloat16_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100")
    cuda = CudaPlatform()
    assert cuda.unsupported_dtype_reason(torch.bfloat16) == (
        "Tesla V100 has no native bfloat16 support"
    )
    assert cuda.unsupported_dtype_reason(torch.float16) is None
    assert simulate(cuda).unsupported_dtype_reason(torch.bfloat16) is None
