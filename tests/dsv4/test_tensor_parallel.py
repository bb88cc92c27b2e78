"""Tensor and expert parallelism: each rank holds its share, and N ranks compute what one does.

In-process (no collective needed): sizes that do not split the model are refused in one line;
the split part of the parameters scales as 1/N while the replicated part stays; the shares of a
full model tile it; a checkpoint written by ``dsv4 init-checkpoint`` (plain, FP8, FP8 with MXFP4
experts) loads on each rank to exactly the share of the full model, reading only that share;
an FP8 split that crosses scale blocks is refused in one line.

Across processes (gloo on 127.0.0.1, ``tests.dsv4.ranks``: every run has a deadline and always
joins its processes): on 2 and 4 ranks the logits of prefill, chunked prefill and decode equal
the single-rank logits within 1e-5 on every rank, identically on every rank; and a capture on
the CPU tape with collectives as eager breaks (``collectives_in_graph=False``) breaks once per
collective, passes the audit and replays equal to eager.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import runners.cli.init_checkpoint as init_checkpoint
from dsv4.checkpoint import load_checkpoint, save_random_checkpoint
from dsv4.config import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.parallel import ParallelSizeError, TensorParallel, check_parallel_size
from dsv4.quant_formats import QuantizationError
from dsv4.quant_layers import QuantizedExperts, QuantizedLinear
from dsv4.quantized_writer import save_random_quantized_checkpoint
from dsv4.shard_reader import ShardReader
from dsv4.sharding import parameter_bytes, shard_model, split_dim
from dsv4.testing import chunk_schedule, configs, random_model, run_schedule
from graphs import NarrowRegion
from tests.dsv4.ranks import run_ranks
from tests.dsv4.test_capture import _eager_reference, _Harness

TIMEOUT = 120.0
"""Seconds a multi-process run may take before every rank is stopped."""
PROMPTS = [list(range(3, 16)), list(range(40, 61))]  # below every vocabulary (64)
SCHEDULES = {
    "prefill": [[(0, 13), (1, 21)]],
    "chunked prefill": chunk_schedule([[5, 3, 5], [7, 7, 4, 3]]),
    "decode": chunk_schedule([[1] * 13, [1] * 21]),
}
COLLECTIVES = 1 + 2 * DeepseekV4Config.tiny().num_hidden_layers + 1
"""Per forward: the embedding all-reduce, one after each attention and each MoE, the gather."""


def _ranks(size: int) -> list[TensorParallel]:
    """Every rank of ``size`` (no process group: building and loading need no collective)."""
    return [TensorParallel(rank=rank, size=size) for rank in range(size)]


# -- sizes ------------------------------------------------------------------------------------

FIELDS = "num_attention_heads, o_groups, n_routed_experts, moe_intermediate_size, vocab_size"


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({}, 3, f"tensor-parallel size 3 does not divide num_attention_heads (4); use a size "
         f"that divides {FIELDS}"),
        ({}, 4, f"tensor-parallel size 4 does not divide o_groups (2); use a size that divides "
         f"{FIELDS}"),
        ({"n_routed_experts": 6}, 4, f"tensor-parallel size 4 does not divide o_groups (2); "
         f"use a size that divides {FIELDS}"),
        ({"n_routed_experts": 5}, 2, f"tensor-parallel size 2 does not divide n_routed_experts "
         f"(5); use a size that divides {FIELDS}"),
        ({"moe_intermediate_size": 65}, 2, f"tensor-parallel size 2 does not divide "
         f"moe_intermediate_size (65); use a size that divides {FIELDS}"),
        ({"vocab_size": 321}, 2, f"tensor-parallel size 2 does not divide vocab_size (321); "
         f"use a size that divides {FIELDS}"),
        ({}, 0, "tensor-parallel size must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_a_size_that_does_not_split_the_model_is_refused_in_one_line(
    changes: dict[str, int], size: int, message: str
) -> None:
    config = attrs.evolve(DeepseekV4Config.tiny(), **changes)
    with pytest.raises(ParallelSizeError) as error:
        check_parallel_size(config, size)
    assert str(error.value) == message
    if size > 0:
        with pytest.raises(ParallelSizeError, match=r"^tensor-parallel size \d+ does not"):
            DeepseekV4ForCausalLM(config, parallel=TensorParallel(rank=0, size=size))


def test_the_split_parameter_bytes_scale_as_one_over_n() -> None:
    """Measured on the ``small`` preset, every rank of N = 1, 2, 4."""
    config = DeepseekV4Config.small()
    whole = parameter_bytes(DeepseekV4ForCausalLM(config, initialize=False))
    for size in (1, 2, 4):
        for parallel in _ranks(size):
            held = parameter_bytes(
                DeepseekV4ForCausalLM(config, initialize=False, parallel=parallel)
            )
            assert held.sharded * size == whole.sharded
            assert held.replicated == whole.replicated
    assert whole.sharded > 10 * whole.replicated


# -- shares of a full model and of checkpoints ------------------------------------------------


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as values: weight-only modules stand for their dequantized weights under
    the plain parameters' names."""
    values, replaced = {}, []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            values[f"{name}.weight"] = module.dequantized()
            replaced.append(f"{name}.")
        elif isinstance(module, QuantizedExperts):
            values[f"{name}.gate_up_proj"] = module.gate_up_proj.dequantized()
            values[f"{name}.down_proj"] = module.down_proj.dequantized()
            replaced.append(f"{name}.")
    for key, value in model.state_dict().items():
        if not key.startswith(tuple(replaced)):
            values[key] = value
    return values


def _assert_equal_states(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name


def test_the_shares_of_a_full_model_tile_it() -> None:
    full = random_model(DeepseekV4Config.tiny(), 5)
    shares = [shard_model(full, parallel).state_dict() for parallel in _ranks(2)]
    for name, value in full.state_dict().items():
        dim = split_dim(name)
        if dim is None:
            assert all(torch.equal(share[name], value) for share in shares), name
        else:
            assert torch.equal(torch.cat([share[name] for share in shares], dim), value), name


def test_shard_model_takes_only_a_full_model_of_plain_parameters(tmp_path: Path) -> None:
    config = DeepseekV4Config.tiny()
    save_random_quantized_checkpoint(tmp_path, config, 1, expert_dtype="fp8")
    with pytest.raises(ValueError) as error:
        shard_model(load_checkpoint(tmp_path, progress=None), TensorParallel(rank=0, size=2))
    assert str(error.value) == (
        "shard_model takes a model of plain parameters: 'model.layers.0.self_attn.q_a_proj."
        "weight' is torch.float8_e4m3fn [64, 128], expected torch.float32 [64, 128] (load a "
        "quantized checkpoint with load_checkpoint(..., parallel=...))"
    )
    share = random_model(config, 1, parallel=TensorParallel(rank=1, size=2))
    with pytest.raises(ValueError, match=r"^shard_model takes a full model, not rank 1's share$"):
        shard_model(share, TensorParallel(rank=0, size=2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What ``dsv4 init-checkpoint --preset tiny`` writes, per ``--quantization``."""
    parser = argparse.ArgumentParser()
    init_checkpoint.add_arguments(parser)
    written = {}
    for quantization in ("none", "fp8", "fp8-fp4"):
        directory = tmp_path_factory.mktemp(quantization)
        init_checkpoint.execute(
            parser.parse_args([str(directory), "--force", "--quantization", quantization])
        )
        written[quantization] = directory
    return written


@pytest.mark.parametrize(
    ("quantization", "mode"),
    [
        ("none", "auto"),
        *((q, m) for q in ("fp8", "fp8-fp4") for m in ("weight-only", "dequantize")),
    ],
)
def test_a_checkpoint_loads_each_ranks_share(
    checkpoints: dict[str, Path], quantization: str, mode: str
) -> None:
    """Each rank's share equals the share of the whole checkpoint (dequantized), bit for bit."""
    directory = checkpoints[quantization]
    full = load_checkpoint(directory, quantization="dequantize", progress=None)
    for parallel in _ranks(2):
        share = load_checkpoint(directory, quantization=mode, progress=None, parallel=parallel)
        assert share.parallel == parallel
        _assert_equal_states(_values(share), shard_model(full, parallel).state_dict())


def test_four_ranks_load_their_shares(tmp_path: Path) -> None:
    """Four output groups (tiny has two), plain and FP8: every split 4 ways."""
    config = attrs.evolve(DeepseekV4Config.tiny(), o_groups=4)
    save_random_checkpoint(tmp_path / "plain", config, 2)
    save_random_quantized_checkpoint(tmp_path / "fp8", config, 2, expert_dtype="fp8")
    for directory in (tmp_path / "plain", tmp_path / "fp8"):
        full = load_checkpoint(directory, quantization="dequantize", progress=None)
        for parallel in _ranks(4):
            share = load_checkpoint(directory, progress=None, parallel=parallel)
            _assert_equal_states(_values(share), shard_model(full, parallel).state_dict())


def test_a_rank_reads_only_its_share_of_the_stored_bytes(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[int] = []
    read = ShardReader.read

    def counting(self: ShardReader, stored: Any, index: Any = ()) -> torch.Tensor:
        piece = read(self, stored, index)
        served.append(piece.numel() * piece.element_size())
        return piece

    monkeypatch.setattr(ShardReader, "read", counting)
    whole = parameter_bytes(load_checkpoint(checkpoints["none"], progress=None))
    assert sum(served) == whole.total
    for parallel in _ranks(2):
        served.clear()
        load_checkpoint(checkpoints["none"], progress=None, parallel=parallel)
        assert sum(served) == whole.replicated + whole.sharded // 2


def test_an_fp8_split_across_scale_blocks_is_refused_in_one_line(tmp_path: Path) -> None:
    """Shared-expert rows 96..191 of 192 straddle the 128-row block boundary."""
    config = attrs.evolve(DeepseekV4Config.tiny(), moe_intermediate_size=192)
    save_random_quantized_checkpoint(tmp_path, config, 1, expert_dtype="fp8")
    load_checkpoint(tmp_path, progress=None, parallel=TensorParallel(rank=0, size=2))
    with pytest.raises(QuantizationError) as error:
        load_checkpoint(tmp_path, progress=None, parallel=TensorParallel(rank=1, size=2))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tensor 'layers.0.ffn.shared_experts.w")
    assert "cannot be split for tensor parallelism: the part 96..191 of dimension" in message
    assert message.endswith(
        "does not fit 128-wide FP8 scale blocks (a part must start on a block boundary or lie "
        "within one block) (in model.safetensors)"
    )


# -- across processes -------------------------------------------------------------------------


def _drawn_configs(parallel: int, count: int) -> list[DeepseekV4Config]:
    """``count`` random tiny configs that ``parallel`` ranks split, the same on every run."""
    drawn: list[DeepseekV4Config] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(configs(parallel=parallel))
    def draw(config: DeepseekV4Config) -> None:
        drawn.append(config)

    draw()
    return drawn[:count]


Logits = dict[str, list[np.ndarray]]
"""Per ``"<config index> <schedule>"`` key, each prompt's logits."""


def _arrays(logits: list[torch.Tensor]) -> list[np.ndarray]:
    """Plain arrays (they pickle through a queue without shared memory)."""
    return [t.numpy().copy() for t in logits]


def _sharded_logits(parallel: TensorParallel, models: list[DeepseekV4Config]) -> dict[str, Any]:
    """On one rank: the logits of every config (seeded by its index) and schedule; on two
    ranks also the capture's layout, audit and replayed logits."""
    found: dict[str, Any] = {}
    for index, config in enumerate(models):
        share = random_model(config, index + 1, parallel=parallel)
        for name, steps in SCHEDULES.items():
            found[f"{index} {name}"] = _arrays(run_schedule(share, PROMPTS, steps))
    if parallel.size == 2:
        found["capture"] = _captured(parallel)
    return found


class _ParallelHarness(_Harness):
    """``test_capture``'s harness with collectives as eager breaks."""

    def context(self, chunks: list[Any]) -> Any:
        return attrs.evolve(super().context(chunks), collectives_in_graph=False)


def _captured(parallel: TensorParallel) -> dict[str, Any]:
    """Capture the tiny model's share on the CPU tape (narrow region, persistent metadata,
    audit raising) and replay ``test_capture``'s schedule."""
    harness = _ParallelHarness(
        random_model(DeepseekV4Config.tiny(), 11, parallel=parallel),
        persistent=True,
        region=NarrowRegion(),
    )
    capture, logits = harness.capture(full=False)
    return {
        "layout": capture.layout,
        "breaks": capture.num_eager_breaks,
        "audit": (capture.audit_mode, capture.audit_report.ok),
        "logits": _arrays(harness.replay_schedule(capture, logits)),
    }


def _assert_equal_to_one_rank(
    results: list[dict[str, Any]], models: list[DeepseekV4Config]
) -> None:
    """Every rank's logits within 1e-5 of one rank's, and the same on every rank."""
    for index, config in enumerate(models):
        full = random_model(config, index + 1)
        for name, steps in SCHEDULES.items():
            key = f"{index} {name}"
            expected = run_schedule(full, PROMPTS, steps)
            for rank, result in enumerate(results):
                ours = [torch.from_numpy(a) for a in result[key]]
                for a, b in zip(ours, expected, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"{key}, rank {rank}")
                same = zip(result[key], results[0][key], strict=True)
                assert all(np.array_equal(a, b) for a, b in same), f"{key}, rank {rank}"


@pytest.fixture(scope="module")
def two_rank_models() -> list[DeepseekV4Config]:
    return [DeepseekV4Config.tiny(), *_drawn_configs(2, 2)]


@pytest.fixture(scope="module")
def two_ranks(two_rank_models: list[DeepseekV4Config]) -> list[dict[str, Any]]:
    return run_ranks(_sharded_logits, 2, two_rank_models, timeout=TIMEOUT)


def test_two_ranks_compute_the_logits_of_one(
    two_ranks: list[dict[str, Any]], two_rank_models: list[DeepseekV4Config]
) -> None:
    _assert_equal_to_one_rank(two_ranks, two_rank_models)


@pytest.mark.slow
def test_four_ranks_compute_the_logits_of_one() -> None:
    models = [attrs.evolve(DeepseekV4Config.tiny(), o_groups=4), *_drawn_configs(4, 1)]
    _assert_equal_to_one_rank(run_ranks(_sharded_logits, 4, models, timeout=TIMEOUT), models)


def test_each_collective_is_an_eager_break_on_the_cpu_tape(
    two_ranks: list[dict[str, Any]],
) -> None:
    attention = "GEGEGE" * DeepseekV4Config.tiny().num_hidden_layers
    for result in two_ranks:
        captured = result["capture"]
        assert captured["audit"] == ("raise", True)
        assert captured["breaks"] == 3 + COLLECTIVES  # three attention regions
        assert captured["layout"] == "GE" + attention + "GEG"
        expected = _eager_reference(DeepseekV4Config.tiny())
        for ours, reference in zip(captured["logits"], expected, strict=True):
            torch.testing.assert_close(torch.from_numpy(ours), reference, rtol=0, atol=1e-5)
