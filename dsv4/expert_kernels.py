"""Routed experts computed on their weights in place: no copy of any expert, only chosen experts
read (the CPU formulations of ``dsv4.experts``).

Both functions take ``x [T, hidden]``, the chosen ``experts [T, k]`` and stacks
``gate_up [E, 2I, hidden]``, ``down [E, hidden, I]`` laid out columns first (each expert's
transpose contiguous, ``dsv4.experts.columns_first``), and return each (token, expert) slot's
clamped-SwiGLU output ``[T, k, hidden]``. Shapes are static and nothing is read on the host.

- ``bagged``: each slot's product as a weighted sum of its expert's rows (its transpose's):
  ``embedding_bag`` with per-sample weights, the slot's inputs weighting rows
  ``expert * width .. expert * width + width - 1`` of the ``[E * width, out]`` table. A slot
  reads its expert whole, streaming (measured at about twice the bandwidth MKL reaches for a
  matrix-vector product on this project's CPU); two slots of one expert read it twice, so it
  suits steps with few slots per expert (decode).
- ``routed``: the whole weighted sum over the slots in one native operator
  (``dsv4::routed_experts_into``, ``dsv4/_kernels.c``) for float32 on one CPU thread: each
  chosen expert read once per block of six of its rows, its products by FMA instructions, and
  a token's output independent of the tokens beside it (the other two give each slot's output;
  this one gives their weighted sum). It reads the stacks ``in_panels``: the columns-first
  stacks themselves as one panel each, or a copy in panels of ``PANEL`` columns, which it
  streams at the machine's read bandwidth (``dsv4.panels``).
- ``grouped``: the slots sorted by expert (stably) and one matrix product per expert over the
  rows routed to it (``torch._grouped_mm``, group ends from one ``searchsorted``): each chosen
  expert read once however many slots chose it (prefill, large batches). ``_grouped_mm``
  needs rows whose bytes are a multiple of 16 (``grouped_fits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.native_ops import ROUTED_EXPERTS_INTO, SWIGLU_INTO, native_takes, row_stride

__all__ = [
    "ROUTED_TOKENS",
    "bagged",
    "grouped",
    "grouped_fits",
    "routed",
    "routed_takes",
    "swiglu",
    "swiglu_of",
]

ROUTED_TOKENS = 1024
"""Tokens ``routed`` hands its operator per call; a longer step runs it on consecutive chunks of
this many (a token's sum never depends on the step's other tokens, so chunks change no bit, and
the kernel's scratch stays bounded). Measured, one thread, the small preset's 16 experts of
512 x 512 and 256 x 512 read in panels, 4 slots per token: 0.29x grouped's time at 1 token,
0.27-0.48x at 16-128, 0.75-0.78x at 256-512, 0.58x at 1,024. Before chunks, a step of more
tokens took another formulation (at 2,048 tokens of ``small``, every expert: ATen's products,
whose sums depend on the row count and the instruction set): a 5,083-token bf16 prefill in
chunks of 2,048 took 9.0 s against 3.3 s chunked (91.8 s against 7.6 s with AVX2 forced)."""


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamped SwiGLU activation: the gate clamped from above, the up projection on both
    sides, at ``limit``. On the CPU one native op (``dsv4.native_ops``) for float32 rows."""
    rows = gate.numel() // gate.shape[-1] if gate.dim() and gate.shape[-1] else 0
    native = rows and gate.shape == up.shape and native_takes()
    if native and row_stride(gate, rows) is not None and row_stride(up, rows) is not None:
        out = gate.new_empty(gate.shape)
        SWIGLU_INTO(out, gate, up, limit)
        return out
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_of(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``swiglu`` of the two halves of ``gate_up`` along its last axis (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, limit)


def _bag(stack: torch.Tensor, slots: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``inputs [n, width]`` times the transpose of ``stack [E, out, width]``'s expert at each
    of the ``n`` ``slots``: ``[n, out]``."""
    num_experts, out, width = stack.shape
    table = stack.transpose(1, 2).view(num_experts * width, out)
    columns = torch.arange(width, device=slots.device)
    rows = (slots * width).unsqueeze(-1).add(columns).view(-1)
    offsets = torch.arange(0, rows.numel(), width, device=slots.device)
    weights = inputs.reshape(-1)
    return F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=weights)


def bagged(
    x: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Every slot on its expert's weights, one ``embedding_bag`` per projection."""
    tokens, k = experts.shape
    slots = experts.reshape(-1)
    inputs = x.unsqueeze(1).expand(tokens, k, x.shape[1])
    hidden = swiglu_of(_bag(gate_up, slots, inputs), limit)
    return _bag(down, slots, hidden).view(tokens, k, -1)


def grouped_fits(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether ``_grouped_mm`` takes these rows: each a multiple of 16 bytes."""
    rows = (gate_up.shape[2], gate_up.shape[1] // 2)
    return all(width * x.element_size() % 16 == 0 for width in rows)


def grouped(
    x: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Slots sorted by expert, one product per expert; outputs back in slot order. ``ends[e]``
    is the end of expert ``e``'s rows (an empty group reads nothing)."""
    tokens, k = experts.shape
    by_expert, order = torch.sort(experts.reshape(-1), stable=True)
    ids = torch.arange(gate_up.shape[0], device=x.device)
    ends = torch.searchsorted(by_expert, ids, right=True, out_int32=True)
    rows = x.index_select(0, order.div(k, rounding_mode="floor"))
    gate_up_rows = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    hidden = swiglu_of(gate_up_rows, limit)
    out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=ends)
    return torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, -1)


def routed_takes(
    x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> bool:
    """Whether ``routed`` runs: float32 tokens on one CPU thread, the kernels built, int64
    choices and float32 stacks ``in_panels`` (contiguous)."""
    return (
        x.shape[0] > 0
        and torch.get_num_threads() == 1
        and experts.dtype == torch.int64
        and experts.device.type == "cpu"
        and gate_up.dim() == down.dim() == 4
        and native_takes(x, gate_up, down)
    )


def routed(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``sum over slots j of weights[t, j] * expert_{experts[t, j]}(x[t])`` ``[T, hidden]`` in
    native operator per ``ROUTED_TOKENS`` tokens (where ``routed_takes``), the stacks
    ``in_panels``."""
    out = x.new_empty(x.shape)
    experts, weights = experts.contiguous(), weights.float().contiguous()
    for start in range(0, x.shape[0], ROUTED_TOKENS):
        rows = slice(start, start + ROUTED_TOKENS)
        ROUTED_EXPERTS_INTO(out[rows], x[rows], experts[rows], weights[rows], gate_up, down, limit)
    return out
