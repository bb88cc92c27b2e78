"""Weight-only modules: the plain module's output with the dequantized weights, bit for bit, and
capturable on the CPU op tape (replay equals eager; the tape refuses nothing).

Every module is built from checkpoint-format bytes (FP8 blocks with partial edges, float32 and
ue8m0 scales; MXFP4 experts) and compared with the plain module holding
``QuantizedTensor.dequantize`` of the same bytes, i.e. what the *dequantize* mode loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import pytest
import torch
from torch import nn

from dsv4.config import DeepseekV4Config
from dsv4.layers import GroupedLinear
from dsv4.moe import Experts, MoE
from dsv4.quant_formats import QuantizationError, QuantizedTensor
from dsv4.quant_layers import (
    QuantizedExperts,
    QuantizedExpertStack,
    QuantizedGroupedLinear,
    QuantizedLinear,
    install_weight_only,
)
from dsv4.quantized_writer import quantize_fp8, quantize_mxfp4
from graphs import BreakableCapture, TapeBackend
from graphs._ops import QuietDispatchMode
from graphs._tensor_refs import WeakStorage, storage_key
from graphs.allocations import new_allocations

BLOCK = (128, 128)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One CPU thread, so that eager runs and tape replays split work alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fp8(weight: torch.Tensor, scale_fmt: str) -> QuantizedTensor:
    q, scale = quantize_fp8(weight, BLOCK, scale_fmt)
    return QuantizedTensor.fp8("w", q, scale, BLOCK)


def _quantize(weight: torch.Tensor, fmt: str) -> QuantizedTensor:
    if fmt == "mxfp4":
        packed, scale = quantize_mxfp4(weight)
        return QuantizedTensor.mxfp4("w", packed, scale)
    return _fp8(weight, fmt)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _replays_like_eager(
    program: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], replays: int = 3
) -> None:
    """Capture ``program`` on the tape, replay on fresh inputs, compare with eager bit for bit."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    with torch.inference_mode():
        with BreakableCapture(TapeBackend()) as capture:  # raises on any uncapturable op
            out = program(x)
        for _ in range(replays):
            x.copy_(torch.randn(shape, generator=generator))
            capture.replay()
            assert _same(out, program(x.clone()))


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("shape", [(96, 160), (256, 128), (200, 40)])
def test_quantized_linear_equals_nn_linear_on_dequantized_weights(
    scale_fmt: str, shape: tuple[int, int]
) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)) / 10
    quantized = _fp8(weight, scale_fmt)
    module = QuantizedLinear(quantized, torch.float32)
    plain = nn.Linear(shape[1], shape[0], bias=False)
    with torch.no_grad():
        plain.weight.copy_(quantized.dequantize())
    x = torch.randn(5, shape[1])
    with torch.inference_mode():
        assert _same(module(x), plain(x))
    _replays_like_eager(module, (3, shape[1]))


def test_quantized_linear_in_bfloat16_equals_the_bfloat16_dequantization() -> None:
    quantized = _fp8(torch.randn(160, 96) / 10, "float")
    module = QuantizedLinear(quantized, torch.bfloat16)
    plain = nn.Linear(96, 160, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(quantized.dequantize(torch.bfloat16))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(module(x), plain(x))


def test_quantized_grouped_linear_equals_grouped_linear() -> None:
    quantized = _fp8(torch.randn(192, 72) / 10, "ue8m0")
    module = QuantizedGroupedLinear(quantized, torch.float32, groups=3)
    plain = GroupedLinear(72, 192, groups=3)
    with torch.no_grad():
        plain.weight.copy_(quantized.dequantize())
    x = torch.randn(5, 3, 72)
    with torch.inference_mode():
        assert _same(module(x), plain(x))
    _replays_like_eager(module, (2, 3, 72))


def _expert_stacks(
    fmt: str, experts: int, hidden: int, inter: int, seed: int = 0
) -> tuple[QuantizedExpertStack, QuantizedExpertStack]:
    generator = torch.Generator().manual_seed(seed)
    gate_up = [
        [_quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(2)]
        for _ in range(experts)
    ]
    down = [
        [_quantize(torch.randn(hidden, inter, generator=generator) / 8, fmt)]
        for _ in range(experts)
    ]
    return (
        QuantizedExpertStack.from_pieces("gate_up", gate_up, torch.float32),
        QuantizedExpertStack.from_pieces("down", down, torch.float32),
    )


@pytest.mark.parametrize("fmt", ["float", "ue8m0", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 6])  # 1: gathered weights (E > 2Tk), 6: every expert
def test_quantized_experts_equal_experts_and_replay_like_eager(fmt: str, tokens: int) -> None:
    experts, hidden, inter, k = 9, 64, 96, 2
    gate_up, down = _expert_stacks(fmt, experts, hidden, inter)
    module = QuantizedExperts(gate_up, down, limit=1.5)
    plain = Experts(experts, hidden, inter, limit=1.5)
    with torch.no_grad():
        plain.gate_up_proj.copy_(gate_up.dequantized())
        plain.down_proj.copy_(down.dequantized())
    generator = torch.Generator().manual_seed(3)
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    with torch.inference_mode():
        assert _same(module(x, chosen, weights), plain(x, chosen, weights))
        rows = gate_up.rows(chosen)
        assert _same(rows, gate_up.dequantized()[chosen])

    def program(x: torch.Tensor) -> torch.Tensor:
        return module(x, chosen, weights)

    _replays_like_eager(program, (tokens, hidden))


@pytest.mark.parametrize("fmt", ["ue8m0", "mxfp4"])
def test_every_expert_on_every_token_dequantizes_a_bounded_chunk_of_experts_at_a_time(
    fmt: str,
) -> None:
    """The every-expert formulation (here 32 experts, 16 tokens, k = 2) once dequantized every
    expert in float32 per call: about 24 GiB at the published sizes. It takes experts a chunk
    at a time, so the bytes a call allocates at its peak stay near ``dense_chunk_bytes``, and
    its output is the whole-stack one's (and the plain module's) bit for bit."""
    experts, hidden, inter, k, tokens = 32, 64, 96, 2, 16
    gate_up, down = _expert_stacks(fmt, experts, hidden, inter)
    module = QuantizedExperts(gate_up, down, limit=1.5)
    plain = Experts(experts, hidden, inter, limit=1.5)
    with torch.no_grad():
        plain.gate_up_proj.copy_(gate_up.dequantized())
        plain.down_proj.copy_(down.dequantized())
    generator = torch.Generator().manual_seed(4)
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    whole_float32 = 4 * experts * 3 * inter * hidden  # both stacks dequantized: 2.25 MiB
    module.dense_chunk_bytes = whole_float32 // 8
    with torch.inference_mode():
        tracker = _PeakNewBytes()
        with tracker:
            out = module(x, chosen, weights)
        assert _same(out, plain(x, chosen, weights))
    assert tracker.peak <= whole_float32 // 4, f"peak {tracker.peak} B of {whole_float32} B"


class _PeakNewBytes(QuietDispatchMode):
    """The peak of the bytes the ops run under it allocate and still hold (views of memory from
    before it, such as the weights, allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[WeakStorage, int]] = {}
        self.peak = 0

    def dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:  # type: ignore[type-arg]
        result = func(*args, **kwargs)
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        for t in new_allocations(func, args, kwargs, result):
            storage = t.untyped_storage()
            self._live.setdefault(storage_key(t), (WeakStorage(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self._live.values()))
        return result


@pytest.mark.parametrize("expert_fmt", ["float", "mxfp4"])
def test_weight_only_moe_captures_on_the_tape_with_routing_from_the_input(expert_fmt: str) -> None:
    """The whole MoE (router, quantized experts, quantized shared expert) on the tape: the
    routing changes with each replayed input and the gathered rows follow it."""
    config = attrs.evolve(DeepseekV4Config.tiny(), n_routed_experts=8)
    moe = MoE(config, layer_idx=1)  # top-k routed
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / 8)
    quantized: dict[str, QuantizedTensor] = {}
    for name, parameter in moe.named_parameters():
        if name.startswith("shared_experts."):
            quantized[name] = _fp8(parameter.detach(), "ue8m0")
        elif name.startswith("experts."):
            value = parameter.detach()
            parts = value.unflatten(1, (2, -1)) if name.endswith("gate_up_proj") else value[:, None]
            pieces = [[_quantize(p, expert_fmt) for p in expert] for expert in parts]
            per_expert = [QuantizedTensor.stack(name, row) for row in pieces]
            quantized[name] = QuantizedTensor.stack(name, per_expert)
    replaced = install_weight_only(moe, quantized, torch.float32)
    assert replaced == set(quantized)
    assert isinstance(moe.experts, QuantizedExperts)
    input_ids = torch.tensor([3])  # one token, 8 experts > 2 * T * k: gathered expert rows

    def program(x: torch.Tensor) -> torch.Tensor:
        return moe(x, input_ids)

    _replays_like_eager(program, (1, config.hidden_size))


def test_install_weight_only_refuses_what_it_cannot_hold() -> None:
    moe = MoE(DeepseekV4Config.tiny(), layer_idx=1)
    fp8 = _fp8(torch.zeros(64, 128), "float")
    with pytest.raises(QuantizationError, match=r"'shared_experts\.down_proj\.weight' dequantizes"):
        install_weight_only(moe, {"shared_experts.down_proj.weight": fp8}, torch.float32)
    with pytest.raises(QuantizationError, match=r"'gate\.weight' is not a linear"):
        install_weight_only(moe, {"gate.weight": _fp8(torch.zeros(4, 128), "float")}, torch.float32)
    with pytest.raises(QuantizationError, match=r"'nothing\.weight' has no module"):
        install_weight_only(moe, {"nothing.weight": fp8}, torch.float32)
    stack = QuantizedTensor.stack("s", [QuantizedTensor.stack("s", [fp8])] * 4)
    with pytest.raises(QuantizationError, match="need both stacks; 'gate_up_proj'"):
        install_weight_only(moe, {"experts.down_proj": stack}, torch.float32)
