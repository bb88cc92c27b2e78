"""Weight-only modules: quantized bytes resident, dequantized inside each matmul.

Each module keeps its checkpoint bytes and scales as buffers (``weight`` and
``weight_scale_inv``, transformers' names) and, on every call, dequantizes what it needs in
float32 and casts once to its compute ``dtype`` before the matmul. The dequantized values are
therefore bit-identical to those of the *dequantize* mode (``QuantizedTensor.dequantize`` at
load), and each module's output equals the plain module's with those weights, bit for bit:

- ``QuantizedLinear``: ``nn.Linear(bias=False)``'s forward;
- ``QuantizedGroupedLinear``: ``dsv4.layers.GroupedLinear``'s forward;
- ``QuantizedExperts``: ``dsv4.moe.Experts``'s forward (the same two static formulations, the
  same host-constant choice between them); the every-expert formulation dequantizes a bounded
  chunk of experts at a time (``QuantizedExpertStack.experts``), the gathered one only the
  chosen experts' rows (``QuantizedExpertStack.rows``: one ``index_select`` on the bytes and one
  on the scales).

``install_weight_only`` swaps these modules into a built model in place of the plain ones.

Invariants: shapes depend only on the module and input shapes, no op reads a tensor's value on
the host, so every forward captures on the CPU op tape and on CUDA graphs. Buffers keep their
checkpoint dtypes (``float8_e4m3fn``/``int8`` data, float32/``float8_e8m0fnu`` scales): cast a
model holding these modules with ``.to(device)`` only, never ``.to(dtype)`` (which would
re-encode the float8 bytes as values).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from dsv4.layers import GroupedLinear
from dsv4.moe import ExpertFormulations, Experts
from dsv4.quant_formats import QuantizationError, QuantizedTensor, dequantize, fp4_pair_table

__all__ = [
    "QuantizedExpertStack",
    "QuantizedExperts",
    "QuantizedGroupedLinear",
    "QuantizedLinear",
    "install_weight_only",
    "resident_bytes",
]


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer ``module`` holds (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        key = tensor.data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


class _Resident(nn.Module):
    """Holds one ``QuantizedTensor`` as buffers; ``_values(data, scale)`` decodes a slice."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    fp4_table: torch.Tensor

    def __init__(self, quantized: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.format = quantized.format
        self.block_size = quantized.block_size
        self.dtype = dtype
        self.register_buffer("weight", quantized.data)
        self.register_buffer("weight_scale_inv", quantized.scale)
        if quantized.format == "mxfp4":
            table = fp4_pair_table(quantized.data.device)
            self.register_buffer("fp4_table", table, persistent=False)

    def _values(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        table = self.fp4_table if self.format == "mxfp4" else None
        return dequantize(self.format, data, scale, self.block_size, self.dtype, table)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in the compute dtype."""
        return self._values(self.weight, self.weight_scale_inv)


class QuantizedLinear(_Resident):
    """``nn.Linear(in_features, out_features, bias=False)`` over a resident quantized weight."""

    def __init__(self, quantized: QuantizedTensor, dtype: torch.dtype) -> None:
        if len(quantized.shape) != 2:
            raise QuantizationError(
                f"a quantized linear weight must be 2-D, got shape {list(quantized.shape)}"
            )
        super().__init__(quantized, dtype)
        self.out_features, self.in_features = quantized.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.format}, dtype={self.dtype}"


class QuantizedGroupedLinear(QuantizedLinear):
    """``GroupedLinear`` (``groups`` block-diagonal maps over ``weight [groups * out, in]``)."""

    def __init__(self, quantized: QuantizedTensor, dtype: torch.dtype, groups: int) -> None:
        super().__init__(quantized, dtype)
        if self.out_features % groups:
            raise QuantizationError(
                f"grouped weight of {self.out_features} rows does not split into {groups} groups"
            )
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized().view(self.groups, -1, self.in_features)
        return torch.einsum("...gi,goi->...go", x, w)


class QuantizedExpertStack(_Resident):
    """A stack of expert weights: bytes ``[E, P, out_p, in']`` for a logical ``[E, P*out_p, in]``.

    ``P`` parts per expert are concatenated along rows (``gate_up_proj``: ``w1`` then ``w3``,
    ``P = 2``; ``down_proj``: ``P = 1``); each part keeps its own scale grid, so parts whose
    rows are not whole blocks stay exact.
    """

    def __init__(self, quantized: QuantizedTensor, dtype: torch.dtype) -> None:
        if len(quantized.shape) != 4:
            raise QuantizationError(
                f"an expert stack must be [experts, parts, out, in], got {list(quantized.shape)}"
            )
        super().__init__(quantized, dtype)
        experts, parts, rows, cols = quantized.shape
        self.shape = torch.Size((experts, parts * rows, cols))

    @classmethod
    def from_pieces(
        cls, name: str, pieces: list[list[QuantizedTensor]], dtype: torch.dtype
    ) -> QuantizedExpertStack:
        """``pieces[e][p]``: expert ``e``'s part ``p`` (each ``[out_p, in]``)."""
        per_expert = [QuantizedTensor.stack(name, parts) for parts in pieces]
        return cls(QuantizedTensor.stack(name, per_expert), dtype)

    def dequantized(self) -> torch.Tensor:
        """Every expert's weight ``[E, P*out_p, in]`` in the compute dtype."""
        return super().dequantized().view(self.shape)

    def experts(self, start: int, stop: int) -> torch.Tensor:
        """Experts ``start:stop``'s weights in the compute dtype: ``dequantized()[start:stop]``,
        dequantizing only their bytes."""
        values = self._values(self.weight[start:stop], self.weight_scale_inv[start:stop])
        return values.view(stop - start, *self.shape[1:])

    def rows(self, experts: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights ``[*experts.shape, P*out_p, in]`` (``index_select`` of
        their bytes and scales, then dequantized): ``dequantized()[experts]``."""
        index = experts.reshape(-1)
        data, scale = (_select(t, index) for t in (self.weight, self.weight_scale_inv))
        return self._values(data, scale).view(*experts.shape, *self.shape[1:])


def _select(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.index_select(0, index)``, gathering 1-byte dtypes as their ``uint8`` bytes (every
    device gathers bytes; not every one has a float8 gather kernel)."""
    if table.element_size() != 1:
        return table.index_select(0, index)
    return table.view(torch.uint8).index_select(0, index).view(table.dtype)


class QuantizedExperts(ExpertFormulations):
    """``dsv4.moe.Experts`` over quantized stacks ``gate_up_proj [E, 2I, hidden]`` (gate rows
    first) and ``down_proj [E, hidden, I]``: the same formulations (``ExpertFormulations``),
    reading dequantized stacks or only the chosen experts' dequantized rows."""

    def __init__(
        self, gate_up_proj: QuantizedExpertStack, down_proj: QuantizedExpertStack, limit: float
    ) -> None:
        super().__init__()
        if (
            gate_up_proj.shape[0] != down_proj.shape[0]
            or gate_up_proj.shape[1] != 2 * (down_proj.shape[2])
        ):
            raise QuantizationError(
                f"expert stacks gate_up_proj {list(gate_up_proj.shape)} and down_proj "
                f"{list(down_proj.shape)} do not fit together"
            )
        self.limit = limit
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def _stack_shape(self) -> tuple[int, int, int]:
        num_experts, double_inter, hidden_size = self.gate_up_proj.shape
        return num_experts, double_inter, hidden_size

    def _stacks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.experts(start, stop), self.down_proj.experts(start, stop)

    def _chosen_rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.rows(experts), self.down_proj.rows(experts)


# -- installing them into a model -------------------------------------------------------------


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, leaf = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def _module(model: nn.Module, path: str, name: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise QuantizationError(f"quantized tensor {name!r} has no module in the model") from None


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _on(quantized: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    return attrs.evolve(quantized, data=quantized.data.to(device), scale=quantized.scale.to(device))


def install_weight_only(
    model: nn.Module, quantized: Mapping[str, QuantizedTensor], dtype: torch.dtype
) -> set[str]:
    """The *weight-only* mode: replace each module whose weight ``quantized`` holds (canonical
    names) by its quantized twin computing in ``dtype``, on the module's device; return the
    parameter names now served by quantized buffers (the loader must not fill those).

    ``<module>.weight`` of an ``nn.Linear`` (no bias) becomes a ``QuantizedLinear``, of a
    ``GroupedLinear`` a ``QuantizedGroupedLinear``; ``<experts>.gate_up_proj`` plus
    ``<experts>.down_proj`` (both required) of ``dsv4.moe.Experts`` become ``QuantizedExperts``.
    A shape that differs from the model's, or any other target, raises ``QuantizationError``.
    """
    replaced: set[str] = set()
    experts: dict[str, dict[str, QuantizedTensor]] = {}
    for name, tensor in quantized.items():
        path, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            experts.setdefault(path, {})[leaf] = tensor
            continue
        module = _module(model, path, name)
        if leaf != "weight" or not isinstance(module, nn.Linear | GroupedLinear):
            raise QuantizationError(f"quantized tensor {name!r} is not a linear layer's weight")
        if isinstance(module, nn.Linear) and module.bias is not None:
            raise QuantizationError(f"quantized tensor {name!r} belongs to a linear with a bias")
        _check_shape(name, tensor.shape, module.weight.shape)
        on_device = _on(tensor, module.weight.device)
        new: nn.Module
        if isinstance(module, GroupedLinear):
            new = QuantizedGroupedLinear(on_device, dtype, module.groups)
        else:
            new = QuantizedLinear(on_device, dtype)
        parent, attribute = _parent(model, path)
        setattr(parent, attribute, new)
        replaced.add(name)
    for path, stacks in experts.items():
        module = _module(model, path, f"{path}.{next(iter(stacks))}")
        if not isinstance(module, Experts):
            raise QuantizationError(f"quantized tensors under {path!r} are not routed experts")
        missing = {"gate_up_proj", "down_proj"} - set(stacks)
        if missing:
            raise QuantizationError(
                f"weight-only experts {path!r} need both stacks; {sorted(missing)[0]!r} is "
                "not quantized"
            )
        device = _device_of(module)
        built = {}
        for leaf in ("gate_up_proj", "down_proj"):
            stack = QuantizedExpertStack(_on(stacks[leaf], device), dtype)
            _check_shape(f"{path}.{leaf}", stack.shape, getattr(module, leaf).shape)
            built[leaf] = stack
        parent, attribute = _parent(model, path)
        setattr(
            parent,
            attribute,
            QuantizedExperts(built["gate_up_proj"], built["down_proj"], module.limit),
        )
        replaced.update(f"{path}.{leaf}" for leaf in built)
    return replaced


def _check_shape(name: str, got: torch.Size, expected: torch.Size) -> None:
    if tuple(got) != tuple(expected):
        raise QuantizationError(
            f"quantized tensor {name!r} dequantizes to shape {list(got)}, the model expects "
            f"{list(expected)}"
        )
