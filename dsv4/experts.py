"""Routed SwiGLU experts over stacked weights, in five static formulations.

Every formulation computes, for each token and each of its ``k`` chosen experts, the clamped
SwiGLU expert's output ``[T, k, hidden]``, which ``forward`` weights and sums over the ``k``
slots the same way whatever the formulation; the native one gives that weighted sum directly.
Which one runs is a host-constant decision from the device, the dtype, the thread count and the
shapes (frozen per captured size), with no data-dependent shape and no host sync in any of
them, so the MoE captures on the CPU tape and in CUDA graphs.

On a CPU, for float32, bfloat16 and float16 stacks that fit ``dense_chunk_bytes`` whole (a
weight-only stack is dequantized into one, ``_resident_stacks``), the chosen experts' weights
are read in place (``dsv4.expert_kernels``): **routed** (one native operator for the whole
weighted sum per ``ROUTED_TOKENS`` tokens, each chosen expert read once per block of four of
its rows) on one thread (float32, or bfloat16 and float16 widened on the stacks' float32
copies, the sum rounded once: ``dsv4.panels.PACKED_DTYPES``), whatever the step's length, else
**bagged**
(``embedding_bag``, each slot reading its expert) while a step has at most
``BAG_SLOTS_PER_EXPERT`` slots per expert, **grouped** (``torch._grouped_mm``, each chosen
expert read once) above, where its row widths allow. On a GPU ``_grouped_mm`` reads its group
offsets on the host outside bfloat16 on recent architectures, which no graph can capture, so
elsewhere, as before:
- **every expert** (``E <= 2 * T * k``): every expert runs on every token, a bounded chunk of
  experts at a time (``DENSE_CHUNK_BYTES``), and the chosen outputs are gathered;
- **gathered** (otherwise): each token runs on a copy of its chosen experts' weights.

Plain and weight-only experts (``dsv4.quant_layers.QuantizedExperts``) share every line but the
reading of their stacks, hand the kernels the same layout and take the same decision, so they
compute alike, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.expert_kernels import (
    ROUTED_TOKENS,
    bagged,
    grouped,
    grouped_fits,
    routed,
    routed_takes,
    swiglu,
    swiglu_of,
)
from dsv4.layers import as_dtype, read_rows
from dsv4.panels import PanelCopy, in_panels

__all__ = [
    "BAG_SLOTS_PER_EXPERT",
    "DENSE_CHUNK_BYTES",
    "IN_PLACE_DTYPES",
    "ExpertFormulations",
    "Experts",
    "columns_first",
    "swiglu",
]


def _columns_first_empty(num_experts: int, out: int, width: int) -> torch.Tensor:
    """An uninitialised ``[num_experts, out, width]`` stack laid out ``columns_first``."""
    return torch.empty_strided((num_experts, out, width), (out * width, 1, out))


def columns_first(stack: torch.Tensor) -> torch.Tensor:
    """``stack [E, out, in]``, same values, laid out so that each expert's transpose
    ``[in, out]`` is contiguous: the layout every formulation reads (see ``Experts``)."""
    if stack.transpose(1, 2).is_contiguous():
        return stack
    return stack.transpose(1, 2).contiguous().transpose(1, 2)


DENSE_CHUNK_BYTES = 256 << 20
"""What the every-expert formulation may hold per chunk of experts, about: their weights in
float32 three times over (while a weight-only stack dequantizes: its values, its scales
expanded to them, their products) and their activations for every token. At the published
sizes one expert already takes ~0.5 GiB, so each runs alone; whole stacks dequantized at once
took ~24 GiB per call."""

IN_PLACE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the in-place formulations take (``embedding_bag``'s and ``_grouped_mm``'s)."""

BAG_SLOTS_PER_EXPERT = 2
"""Slots per expert up to which the bagged formulation runs (measured, one thread, the small
preset's 16 experts of 512 x 512 and 256 x 512, 4 slots per token: at 1, 2, 4 and 8 tokens it
took 0.66x, 0.66x, 0.69x and 0.73x of grouped's time; at 16 tokens the two were level, and
in whole decode steps of 8 and 16 requests either bound gave the same time)."""


class ExpertFormulations(nn.Module):
    """The static formulations of routed SwiGLU experts over stacked weights
    ``gate_up [E, 2I, hidden]`` (gate rows first) and ``down [E, hidden, I]``.

    A subclass says how its weights are read: ``_stacks(start, stop)`` gives both stacks of
    experts ``start:stop`` in the compute dtype (the every-expert formulation, a chunk at a
    time), ``_chosen_rows(experts)`` the chosen experts' rows ``[T, k, ...]`` (the gathered
    formulation), ``_resident_stacks(experts)`` whole stacks in which every expert of
    ``experts`` holds its weights (the in-place ones); ``limit`` is the SwiGLU clamp.
    Stacks are laid out ``columns_first`` (every subclass hands the kernels the same layout,
    so they compute alike, bit for bit); gathered rows are contiguous.
    """

    limit: float
    dense_chunk_bytes: int = DENSE_CHUNK_BYTES
    """Bytes per chunk of experts of the every-expert formulation (``DENSE_CHUNK_BYTES``)."""

    def _stacks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _stack_shape(self) -> tuple[int, int, int]:
        """``(E, 2I, hidden)``."""
        raise NotImplementedError

    def _chosen_rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _resident_stacks(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, hidden]``, chosen ``experts [T, k]`` and their ``weights`` -> ``[T, hidden]``."""
        # routed takes ROUTED_TOKENS tokens per call, so its activations are at most theirs
        if self._in_place(x, min(x.shape[0], ROUTED_TOKENS)):
            stacks = self._resident_stacks(experts.reshape(-1))
            panels = self._routed_panels(stacks)
            # a narrow x on the float32 copies: widened exactly, the sums in float32, the
            # weighted sum rounded once (``dsv4.panels.PACKED_DTYPES``)
            wide = as_dtype(x, torch.float32)
            if routed_takes(wide, experts, *panels):
                return as_dtype(routed(wide, experts, weights, *panels, self.limit), x.dtype)
            out = self._slot_outputs(x, experts, stacks)
        else:
            out = self._slot_outputs(x, experts)
        return (out * as_dtype(weights, out.dtype).unsqueeze(-1)).sum(dim=1)

    def _routed_panels(
        self, stacks: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks the routed formulation reads (``in_panels``): the resident ``stacks``
        themselves, one panel each."""
        return in_panels(stacks[0]), in_panels(stacks[1])

    def _slot_outputs(
        self,
        x: torch.Tensor,
        experts: torch.Tensor,
        stacks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Each slot's output ``[T, k, hidden]``, by the formulation the shapes choose
        (``stacks``: the resident stacks where the caller already has them)."""
        num_experts = self._stack_shape()[0]
        slots = experts.numel()
        if self._in_place(x):
            if stacks is None:
                stacks = self._resident_stacks(experts.reshape(-1))
            if slots <= BAG_SLOTS_PER_EXPERT * num_experts or not grouped_fits(x, stacks[0]):
                return bagged(x, experts, *stacks, self.limit)
            return grouped(x, experts, *stacks, self.limit)
        if num_experts <= 2 * slots:
            return self._chosen_of_all(x, experts)
        return self._on_gathered_weights(x, experts)

    def _in_place(self, x: torch.Tensor, tokens: int | None = None) -> bool:
        """Whether the chosen experts are read in place (see the module docstring) by a
        formulation holding the activations of ``tokens`` tokens at once (``x``'s, by
        default): the whole stack and they fit ``dense_chunk_bytes``."""
        held = x.shape[0] if tokens is None else tokens
        return (
            x.device.type == "cpu"
            and x.dtype in IN_PLACE_DTYPES
            and self._experts_per_chunk(held) >= self._stack_shape()[0]
        )

    def _chosen_of_all(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's chosen outputs ``[T, k, hidden]``.

        Experts run a chunk at a time (``_experts_per_chunk``), each chunk's chosen outputs
        taken where a token chose one of its experts: every slot is one chunk's, so the result
        is the whole stack's, value for value, and a weight-only stack is only ever dequantized
        a chunk at a time; each expert's transposed weights (contiguous, ``columns_first``)
        are the right operand of one batched product over every token.
        """
        num_experts = self._stack_shape()[0]
        step = self._experts_per_chunk(x.shape[0])
        if step >= num_experts:
            return self._chunk_outputs(x, experts, 0, num_experts)
        chosen = self._chunk_outputs(x, (experts).clamp(0, step - 1), 0, step)
        for start in range(step, num_experts, step):
            stop = min(start + step, num_experts)
            local = (experts - start).clamp(0, stop - start - 1)
            mine = ((experts >= start) & (experts < stop)).unsqueeze(-1)
            chosen = torch.where(mine, self._chunk_outputs(x, local, start, stop), chosen)
        return chosen

    def _chunk_outputs(
        self, x: torch.Tensor, local: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        """Experts ``start:stop`` on every token, gathered at ``local`` (indices into the
        chunk) ``[T, k, hidden]``; its temporaries go when it returns."""
        hidden_size = self._stack_shape()[2]
        gate_up_stack, down_stack = self._stacks(start, stop)
        tokens = x.expand(stop - start, *x.shape)
        gate_up = torch.bmm(tokens, gate_up_stack.transpose(1, 2))  # [C, T, 2I]
        hidden = swiglu_of(gate_up, self.limit)  # [C, T, I]
        out = torch.bmm(hidden, down_stack.transpose(1, 2))  # [C, T, hidden]
        index = local.unsqueeze(-1).expand(*local.shape, hidden_size)
        return out.transpose(0, 1).gather(1, index)

    def _experts_per_chunk(self, tokens: int) -> int:
        """Experts whose float32 weights (three times, see ``DENSE_CHUNK_BYTES``) and
        activations for ``tokens`` tokens fit ``dense_chunk_bytes`` (at least one)."""
        num_experts, double_inter, hidden_size = self._stack_shape()
        weights = 3 * double_inter * hidden_size // 2  # gate_up and down of one expert
        activations = (2 * double_inter + hidden_size) * tokens
        per_expert = 4 * (3 * weights + activations)
        return max(1, min(num_experts, self.dense_chunk_bytes // per_expert))

    def _on_gathered_weights(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token on its chosen experts' gathered weights: ``[T, k, hidden]``."""
        gate_up_rows, down_rows = self._chosen_rows(experts)
        gate_up = torch.einsum("tkoh,th->tko", gate_up_rows, x)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = swiglu(gate, up, self.limit)
        return torch.einsum("tkhi,tki->tkh", down_rows, hidden)


class Experts(ExpertFormulations):
    """Stacked expert weights: ``gate_up_proj [E, 2I, hidden]`` (gate rows first), ``down_proj
    [E, hidden, I]`` (the checkpoint's shapes), laid out ``columns_first``: a product with one
    token then streams each expert's matrix as the right operand of a row-major product, which
    MKL runs about twice as fast as its transpose on this project's CPU (one row against a
    2 MB matrix read from memory), and ``embedding_bag`` and ``_grouped_mm`` read it as they
    need it."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float
    ) -> None:
        super().__init__()
        self.limit = limit
        # torch.empty touches no memory: a model built for loading (parameters on meta, see
        # dsv4.materialize) never holds a float32 copy of the experts; zeroed in place here
        self.gate_up_proj = nn.Parameter(
            _columns_first_empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(
            _columns_first_empty(num_experts, hidden_size, intermediate_size)
        )
        nn.init.zeros_(self.gate_up_proj)
        nn.init.zeros_(self.down_proj)
        # the routed formulation's copies in panels (pack_panels)
        self.gate_up_panels: torch.Tensor | None
        self.down_panels: torch.Tensor | None
        self._copies = (PanelCopy(self, "gate_up_panels"), PanelCopy(self, "down_panels"))

    def _stack_shape(self) -> tuple[int, int, int]:
        num_experts, double_inter, hidden_size = self.gate_up_proj.shape
        return num_experts, double_inter, hidden_size

    def _stacks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj[start:stop], self.down_proj[start:stop]

    def _chosen_rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return read_rows(self.gate_up_proj, experts), read_rows(self.down_proj, experts)

    def _resident_stacks(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj, self.down_proj

    def pack_panels(self) -> int:
        """Keep a copy of both stacks in panels (``dsv4.panels``) for the routed formulation,
        where it can read them: float32 CPU stacks with a ``panel_width``.
        Returns the bytes the copies hold (0: none kept). They are read while the parameters
        hold what they were packed from (``PanelCopy``), and packed again into the same
        buffers after an in-place write (``PanelCopies.refresh``), so a graph captured on them
        reads the new weights."""
        parameters = (self.gate_up_proj, self.down_proj)
        held = [c.pack(self, p, p) for c, p in zip(self._copies, parameters, strict=True)]
        if not all(held):  # one copy is of no use to the routed formulation without the other
            for copy in self._copies:
                copy.drop(self)
            return 0
        return sum(held)

    def _routed_panels(
        self, stacks: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The copies in panels while they hold the parameters' values (``pack_panels``), else
        the parameters themselves, one panel each."""
        gate_up = self._copies[0].get(self, self.gate_up_proj)
        down = self._copies[1].get(self, self.down_proj)
        if gate_up is None or down is None:
            return super()._routed_panels(stacks)
        return gate_up, down
