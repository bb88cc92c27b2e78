"""Small building blocks: RMS norms and the grouped (block-diagonal) output projection.

Numerics follow the reference: norms compute in fp32; a weighted norm multiplies by its fp32
weight before casting back once, so bf16 models round where the reference rounds. Each norm is
one op (plus casts only where the dtype really changes): op count is what a step costs eagerly
and on the CPU tape. On the CPU that op is ``dsv4::rms_norm_into``, one native kernel
(``dsv4/_kernels.c``) where ATen's ``rms_norm`` runs six; elsewhere, where the kernels were not
built, or where autograd records, it is ATen's ``rms_norm``.

Products (``Linear``, ``GroupedLinear``) on one CPU thread run on their weight's float32 copy in
panels (``dsv4.panels``) wherever it is held, at every row count: a narrow model's
(``NARROW_DTYPES``) rows widened exactly, every output summed in the kernel's one order (the same
whichever rows stand beside it and however many), rounded once; the same bits on every
instruction set, in a decode step of one row and in a prefill chunk of a thousand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.native_ops import (
    GATHER_ROWS_INTO,
    GROUPED_LINEAR_INTO,
    LINEAR_INTO,
    LINEAR_PANELS_INTO,
    RMS_NORM_INTO,
    native_takes,
    rows_take,
)
from dsv4.panels import PanelCopy

__all__ = [
    "BLOCK_ROWS",
    "NARROW_DTYPES",
    "SKINNY_ROWS",
    "GroupedLinear",
    "Linear",
    "RMSNorm",
    "as_dtype",
    "linear",
    "panel_product",
    "panels_for",
    "read_rows",
    "rms_norm",
    "rms_normalize",
    "skinny",
]

SKINNY_ROWS = 4
"""Rows up to which a float32 product on one CPU thread *without a copy in panels* (a model that
``dsv4.panels.pack_model`` did not pack) runs the native dot kernel (``dsv4_linear_f32``, FMA:
2-3x MKL's speed at one row, 1.5-2x at four; at 8 rows level with it or faster, at 16 up to 1.3x
slower, so MKL runs above four). Its sums are not the panels' order, so a packed model never
takes it: a token's keys would then depend on whether its chunk had four rows or five."""


BLOCK_ROWS = 64
"""Rows a float32 product in panels multiplies per read of its matrix (``MAX_BLOCK_ROWS`` of
``dsv4/_kernels.c``). Every float32 product on one CPU thread reads its module's copy of the
weight in panels where one is held (``dsv4.panels``; ``LINEAR_PANELS_INTO``), a block of these
rows at a time, whatever the row count, one row included: MKL's sums would depend on the row
count and on the instruction set (a baseline x86-64 CPU's MKL differs from an AVX2 one's in the
last bits), the dot kernel's are in another order, the panels' never change. Measured, one
thread, 512 x 512 in cache, 16 rows: the kernel 81 us, 100 GFLOP/s, MKL's ``mm`` 131 us; level
with MKL at 64 rows; prefill of 2,000 tokens of ``small`` 1.53 s against MKL's 1.56 s."""


NARROW_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose products on one CPU thread run, at any row count, on their weight's float32
copy in panels (``dsv4.panels.PACKED_DTYPES``: exact products, one fixed order of sums, rounded
once): ATen's own narrow products add in an order that depends on the instruction set (oneDNN's
with AVX-512 BF16, ATen's vectorized kernels below it)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm of a float32 ``x`` over its last axis, times ``weight`` if given: the native
    kernel on the CPU (one op, a mean that may round differently from ATen's in its last bit),
    ATen's ``rms_norm`` anywhere else and wherever autograd records."""
    if x.numel() > 0 and native_takes(x, weight):
        out = torch.empty_like(x)
        RMS_NORM_INTO(out, x, weight, eps)
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def skinny(x: torch.Tensor, row_width: int) -> bool:
    """Whether ``x`` is at most ``SKINNY_ROWS`` rows of ``row_width`` values, on one thread: the
    products the native kernel runs (``linear``)."""
    rows = x.numel() // row_width if row_width else 0
    return 0 < rows <= SKINNY_ROWS and torch.get_num_threads() == 1


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias) on a weight held in no panels. At most
    ``SKINNY_ROWS`` rows of float32 on one CPU thread (a decode step) take the native dot
    kernel, one op whose rows do not depend on each other; anything else takes ATen's. (The
    thread count is read when the op is issued, so a graph keeps the choice of its capture.)"""
    few = x.dim() > 0 and weight.dim() == 2 and skinny(x, x.shape[-1])
    if few and native_takes(x, weight):
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        LINEAR_INTO(out, x, weight)
        return out
    return F.linear(x, weight)


def panels_for(
    module: nn.Module, copy: PanelCopy, weight: torch.Tensor, x: torch.Tensor, row_width: int
) -> torch.Tensor | None:
    """``module``'s ``copy`` of ``weight`` in panels where ``x`` (rows of ``row_width``) is one
    native product on it, on one thread, the copy holding the weight's values: any number of
    contiguous float32 rows, or of rows of a narrow dtype (``NARROW_DTYPES``) on a weight of
    that dtype; else ``None``."""
    rows = x.numel() // row_width if row_width else 0
    if rows == 0 or torch.get_num_threads() != 1:
        return None
    if x.dtype in NARROW_DTYPES:
        # the kernels were built, autograd is not recording
        takes = weight.dtype == x.dtype and x.device.type == "cpu" and native_takes()
    else:
        takes = native_takes(x)
    return copy.get(module, weight) if takes else None


def _on_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ weight.T`` on the weight's float32 ``panels``, one native op: a narrow ``x`` is
    widened first (exactly) and the float32 sums rounded to its dtype once, as a narrow product
    rounds them; the sums are the panels' fixed order, so the same bits on every instruction
    set."""
    wide = as_dtype(x, torch.float32).contiguous()
    out = wide.new_empty(*x.shape[:-1], out_features)
    LINEAR_PANELS_INTO(out, wide, panels)
    return as_dtype(out, x.dtype)


def panel_product(
    module: nn.Module, copy: PanelCopy, x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``x @ weight.T``: one native op on ``module``'s ``copy`` of ``weight`` in panels where
    ``panels_for`` finds it, else ``linear``."""
    panels = panels_for(module, copy, weight, x, weight.shape[-1])
    if panels is None:
        return linear(x, weight)
    return _on_panels(x, panels, weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose forward is one native product on its copy of the weight
    in panels (``pack_panels``) on one CPU thread, else ``linear`` (same parameters, same
    checkpoint names; quantized loading replaces it as it replaces ``nn.Linear``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.weight_panels: torch.Tensor | None
        self._copy = PanelCopy(self, "weight_panels")

    def pack_panels(self) -> int:
        """Keep a copy of the weight in panels (``PanelCopy``); returns the bytes it holds."""
        return self._copy.pack_matrix(self, self.weight)

    def panels_for(self, x: torch.Tensor, row_width: int | None = None) -> torch.Tensor | None:
        """The copy in panels a product of the rows of ``x`` reads (``panels_for``), else
        ``None``; ``row_width`` (default: the in-features) is how wide those rows are, so that
        the rows of another product may ask, row for row."""
        width = self.in_features if row_width is None else row_width
        return panels_for(self, self._copy, self.weight, x, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return panel_product(self, self._copy, x, self.weight)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, without issuing an op when it already is (a host-constant decision)."""
    return x if x.dtype == dtype else x.to(dtype)


def read_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table[rows]`` for an index tensor ``rows`` of any shape, as one op: on the CPU a native
    row copy (``gather_rows_into``) where ``rows_take``, else one ``index_select`` (which costs
    less than advanced indexing, eagerly and on the CPU tape)."""
    if rows_take(table, rows):
        out = table.new_empty(*rows.shape, *table.shape[1:])
        GATHER_ROWS_INTO(out, table, rows)
        return out
    picked = table.index_select(0, rows.reshape(-1))
    return picked.view(*rows.shape, *table.shape[1:])


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last axis (statistics in fp32, result in ``x.dtype``).

    For narrower dtypes the scale is rounded to ``x.dtype`` before it multiplies, as the
    reference rounds it.
    """
    if x.dtype == torch.float32:
        return rms_norm(x, None, eps)
    scale = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * scale.to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMS norm; ``weight`` stays fp32 (the model never casts it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(as_dtype(x, torch.float32), self.weight, self.eps)
        return as_dtype(h, x.dtype)


class GroupedLinear(nn.Module):
    """``groups`` independent linear maps, group g using rows ``g*out .. (g+1)*out - 1``.

    ``weight`` is ``[groups * out_per_group, in_per_group]`` (the checkpoint layout); the input
    is ``[..., groups, in_per_group]`` and the output ``[..., groups, out_per_group]``.
    """

    def __init__(self, in_per_group: int, out_total: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_total, in_per_group))
        self.weight_panels: torch.Tensor | None
        self._copy = PanelCopy(self, "weight_panels")

    def pack_panels(self) -> int:
        """Keep a copy of each group's weight in panels (``PanelCopy``); returns its bytes."""
        return self._copy.pack(
            self, self.weight.view(self.groups, -1, self.weight.shape[-1]), self.weight
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Like ``Linear``: on one CPU thread one native op on the copy in panels, or without
        one, for a decode step's few float32 rows, on the weight (each group's weights read once
        for all rows); anything else ATen's ``einsum``."""
        panels = None
        if x.dim() > 1:
            panels = panels_for(self, self._copy, self.weight, x, x.shape[-1] * x.shape[-2])
        if panels is not None:
            return _on_panels(x, panels, panels.shape[1] * panels.shape[3])
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        if x.dim() > 1 and skinny(x, x.shape[-1] * x.shape[-2]) and native_takes(x, w):
            out = x.new_empty(*x.shape[:-1], w.shape[1])
            GROUPED_LINEAR_INTO(out, x, w)
            return out
        return torch.einsum("...gi,goi->...go", x, w)
