"""Window pooling of the KV compressors and the indexer: each complete window of ``m`` tokens
becomes one compressed entry.

Entry ``w`` covers positions ``w*m .. w*m+m-1`` and becomes visible to the query at position
``t`` once that window is complete: ``(w+1)*m - 1 <= t``.

- Heavily compressed (HCA, no overlap): entry = kv_norm(sum over the window's ``m`` tokens of
  softmax-over-slots(gate + position_bias[slot]) * kv), RoPE at position ``w*m``.
- Overlapping (CSA and the indexer): projections are ``2*dim`` wide, split ``[a | b]``; entry
  ``w`` pools ``2m`` slots — the ``a`` halves of window ``w-1`` then the ``b`` halves of window
  ``w`` (window 0's ``a`` slots weigh nothing).
The softmax runs per channel in fp32. On the CPU (float32 caches) gathering the window, the
softmax and the weighted sum are one native op (``dsv4::pool_into``), which leaves a slot before
the request's start out where the composite weighs it by an exact zero.

Per-token formulation (what makes this capturable): every token of the step first writes its
projections into the paged state (``CompressorCache.kv``/``gate``), then every token gathers
the ``m`` (or ``2m``) positions ending at itself through the block table and pools them. Only
a token that completes a window (``(t+1) % m == 0``) writes its pooled entry, into its own
entry row (entry ``w`` of the request, in the entry pool: ``dsv4.paging.EntryPages``); every
other token, and every padded one, writes to the entry tensor's sink. Shapes depend
only on the token count and host constants, and there is no host sync: partial windows persist
across steps in the paged state.

Op economy: where each token reads its window and writes its entry depends only on the rate,
so ``PoolingPlan`` computes it once per step and rate (a CSA layer's compressor and indexer
share one, and its window is a view of the attention layer's); an overlapping window gathers
its ``a`` and ``b`` halves in one ``index_select`` per cache (rows of the ``[2 * rows, dim]``
view of the ``[rows, 2 * dim]`` cache).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from dsv4.cache import CompressorCache
from dsv4.layers import NARROW_DTYPES, Linear, RMSNorm, as_dtype, read_rows
from dsv4.metadata import AttentionMetadata
from dsv4.native_ops import POOL_INTO, native_takes
from dsv4.paging import EntryPages, Window, write_rows
from dsv4.rope import RotaryEmbedding, RotaryTables

__all__ = ["PoolingPlan", "WindowPooler", "entry_capacity", "entry_ends"]


def entry_capacity(metadata: AttentionMetadata, rate: int) -> int:
    """Most entries one request can have within the step's width: the positions the block
    table covers divided by the rate (static)."""
    return int(metadata.block_table.shape[1]) * metadata.block_size // rate


def entry_ends(capacity: int, rate: int, device: torch.device) -> torch.Tensor:
    """``[capacity]`` last position of each entry's window: the first query position that
    sees it."""
    return torch.arange(rate - 1, capacity * rate, rate, device=device)


@attrs.frozen(kw_only=True, eq=False)
class PoolingPlan:
    """Where the tokens of one step read their windows and write their entries (one rate)."""

    phase: torch.Tensor
    """``[T]`` each token's slot in its window (``position % m``)."""
    window_slots: torch.Tensor
    """``[T, span]`` cache slots of the window ending at each token (clamped at position 0)."""
    before_start: torch.Tensor | None
    """``[T, span, 1]`` window positions before the request's start (overlapping windows only;
    they weigh nothing)."""
    entry_rows: torch.Tensor
    """``[T]`` entry-tensor row of the entry each token completes; the entry sink if none."""
    entry_positions: torch.Tensor
    """``[T]`` first position of each token's window (where its entry's RoPE turns)."""

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        rate: int,
        window: Window,
        real: torch.Tensor,
        entries: EntryPages,
        entry_sink: int,
        *,
        overlap: bool,
    ) -> PoolingPlan:
        """The plan for ``rate`` over ``window`` (``span`` positions ending at each token);
        ``real`` ``[T]`` marks the tokens that are not padding, ``entries`` addresses their
        requests' entries of this rate and ``entry_sink`` is the entry tensor's sink row."""
        phase = positions % rate
        entry = entries.rows((positions // rate).unsqueeze(-1))
        completes = (phase == rate - 1) & real
        return cls(
            phase=phase,
            window_slots=window.slots,
            before_start=(window.positions < 0).unsqueeze(-1) if overlap else None,
            entry_rows=torch.where(completes, entry.squeeze(-1), entry_sink),
            entry_positions=positions - phase,
        )


class WindowPooler(nn.Module):
    """Parameters and paged update shared by the compressors and the indexer's key compressor."""

    halves: torch.Tensor

    def __init__(self, hidden_size: int, dim: int, rate: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim = dim
        self.rate = rate
        self.overlap = overlap
        self.span = 2 * rate if overlap else rate
        self.kv_proj = Linear(hidden_size, width)
        self.gate_proj = Linear(hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)
        # which half (a = 0, b = 1) each of the 2m overlapping window slots pools
        halves = torch.tensor([0] * rate + [1] * rate) if overlap else torch.zeros(0)
        self.register_buffer("halves", halves.long(), persistent=False)

    def update(
        self,
        hidden_states: torch.Tensor,
        write: torch.Tensor,
        plan: PoolingPlan,
        cache: CompressorCache,
        rope: RotaryEmbedding,
        entry_tables: RotaryTables,
    ) -> None:
        """Record this step's tokens (at cache rows ``write``) and write every entry a token of
        the step completes (``entry_tables``: rope rows at ``plan.entry_positions``)."""
        kv = self.kv_proj(hidden_states)
        gate = self.gate_proj(hidden_states) + read_rows(self.position_bias, plan.phase)
        write_rows(cache.kv, write, kv)
        write_rows(cache.gate, write, gate)
        kv_rows, gate_rows = cache.kv.view(-1, self.dim), cache.gate.view(-1, self.dim)
        if self.overlap:
            rows = plan.window_slots * 2 + self.halves  # rows of the [2 * rows, dim] views
            masked = plan.before_start
        else:
            rows, masked = plan.window_slots, None
        if native_takes(kv_rows, gate_rows):  # on the CPU: one op, whatever the step's shape
            # (a prefill's window slots are a strided view; copied, the op still runs, so a
            # token's entry never depends on how many tokens its step carries)
            pooled = kv_rows.new_empty(rows.shape[0], self.dim)
            masked = masked.contiguous() if masked is not None else None
            POOL_INTO(pooled, kv_rows, gate_rows, rows.contiguous(), masked)
        elif _widens(kv_rows, gate_rows):  # narrow caches: the same op on float32 copies of
            # the window's rows (exact), rounding where the composite below rounds (each
            # weight, each weighted row, the sum), where ATen's softmax and sums would depend
            # on the instruction set
            order = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
            kv_w = read_rows(kv_rows, rows).float().view(-1, self.dim)
            gate_w = read_rows(gate_rows, rows).float().view(-1, self.dim)
            wide = kv_w.new_empty(rows.shape[0], self.dim)
            masked = masked.contiguous() if masked is not None else None
            POOL_INTO(wide, kv_w, gate_w, order, masked, kv_rows.dtype)
            pooled = as_dtype(wide, kv_rows.dtype)
        else:
            kv_w, gate_w = read_rows(kv_rows, rows), read_rows(gate_rows, rows)
            if masked is not None:
                gate_w = torch.where(masked, float("-inf"), gate_w)
            weights = as_dtype(gate_w.softmax(dim=1, dtype=torch.float32), kv_w.dtype)
            pooled = (kv_w * weights).sum(dim=1)
        entry = rope.rotate(self.kv_norm(pooled), entry_tables.last(self.dim))
        write_rows(cache.entries, plan.entry_rows, entry)


def _widens(kv_rows: torch.Tensor, gate_rows: torch.Tensor) -> bool:
    """Whether a narrow (``NARROW_DTYPES``) cache (its gates float32 or as narrow) pools
    natively on float32 copies of its rows: one CPU thread, the kernels built, autograd not
    recording."""
    return (
        kv_rows.dtype in NARROW_DTYPES
        and gate_rows.dtype in (torch.float32, kv_rows.dtype)
        and kv_rows.device.type == "cpu"
        and torch.get_num_threads() == 1
        and native_takes()
    )
