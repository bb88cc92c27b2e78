"""Weights packed in panels: the layout the native products of a few rows read fastest.

A matrix of ``depth`` x ``width`` (the transpose of an ``nn.Linear`` weight, ``in`` x ``out``,
or of one expert) in panels of ``panel`` columns is ``width / panel`` panels, each of its
``depth`` x ``panel`` values contiguous, one after the other; a stack of such matrices is
``[E, width / panel, depth, panel]`` (``in_panels``). The native kernels
(``dsv4/_kernels.c``: ``panel_columns``) then read a panel as one stream while its sums stay
in registers, and every output is the same sum of fused multiply-adds, ``i`` ascending, whatever
the panels: a copy in panels computes what the matrix itself computes, bit for bit.

Modules keep such a copy beside their parameters (``PanelCopy``) for the one-thread CPU path:
it is made once the weights are final (``pack_model``, which ``runners.spec.build_engine``
calls), read only while the parameters hold what it was packed from, and packed again in place
when a parameter is written in place (``PanelCopies.refresh``, before every step of a runner).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "PACKED_DTYPES",
    "PANEL",
    "PanelCopies",
    "PanelCopy",
    "in_panels",
    "pack_model",
    "panel_width",
]

PANEL = 64
"""Columns per panel (measured, one thread, 96 matrices of 512 x 512 read from memory, four
rows: 29 GB/s in panels of 64 columns, the read bandwidth a plain sum reaches, against 9-11 GB/s
for every order that reads 64 columns of a whole matrix laid out columns first)."""


PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Weight dtypes kept in panels, always as float32: a product of two bfloat16 (or two float16)
values is exact in float32 (8 + 8 or 11 + 11 significant bits, within 24), so the float32
kernels on widened rows add exactly the terms a narrow product adds, in one fixed order on every
instruction set, and the result is rounded to the narrow dtype once (``dsv4.layers``)."""


def panel_width(columns: int) -> int | None:
    """The panel a matrix of ``columns`` columns is packed in: ``PANEL`` where it divides them,
    the whole matrix where it is narrower (the kernel then keeps only the vectors of 16 it
    needs), else none."""
    if columns > 0 and columns % PANEL == 0:
        return PANEL
    return columns if 0 < columns < PANEL else None


def in_panels(stack: torch.Tensor, panel: int | None = None) -> torch.Tensor:
    """``stack [E, out, in]`` as ``[E, out / panel, in, panel]``: each matrix's transpose cut
    into panels of ``panel`` columns, each panel contiguous (a copy), or with ``panel=None`` one
    panel, the stack itself (a view, contiguous where the stack is laid out columns first)."""
    num_experts, out, width = stack.shape
    transposed = stack.transpose(1, 2)
    if panel is None:
        return transposed.unsqueeze(1)
    if out % panel:
        raise ValueError(f"{out} columns do not cut into panels of {panel}")
    return transposed.reshape(num_experts, width, out // panel, panel).transpose(1, 2).contiguous()


class PanelCopy:
    """A module's copy of one of its CPU weights (``PACKED_DTYPES``) in float32 panels, in the
    module's buffer ``name`` (so that a graph may read it; never saved), with the weight it was
    packed from, where that weight lived and its version counter when it was packed.

    The copy stands for the weight's memory, as a CUDA graph's captured read does: a weight
    written in place since is packed again *into the same buffer* (``refresh``, which the
    runner calls before every step), so a replay reads the new values, as a CUDA graph reads
    its parameters' new values. A weight moved to other storage (``.data =``) is not followed:
    a CUDA graph keeps reading the old address too. Until refreshed, ``get`` hands out the copy
    only while the weight still holds what it was packed from; otherwise the weight itself is
    read (the same values, slower)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.name = name
        self._packed_from: tuple[int, int] | None = None
        self._source: torch.Tensor | None = None
        """The parameter packed from, while a copy is held."""
        self._stack: torch.Tensor | None = None
        """The view of it that was packed (``[E, out, in]``, sharing its version counter)."""
        module.register_buffer(name, None, persistent=False)

    def pack(self, module: nn.Module, stack: torch.Tensor, source: torch.Tensor) -> int:
        """Pack ``stack [E, out, in]`` (a view of ``source``) in panels of ``panel_width(out)``:
        returns the bytes held (0, and nothing kept, where it is not float32 on the CPU, has no
        panel width, or ``source`` is an inference tensor, whose writes no counter records).
        A copy already held in the same shape is overwritten in place: graphs captured on it
        read the new one."""
        panel = panel_width(stack.shape[1])
        if (
            panel is None
            or stack.dtype not in PACKED_DTYPES
            or stack.device.type != "cpu"
            or source.is_inference()
        ):
            self.drop(module)
            return 0
        with torch.no_grad():
            packed = in_panels(stack.detach().float(), panel)
            held: torch.Tensor | None = getattr(module, self.name)
            if held is not None and held.shape == packed.shape and not held.is_inference():
                held.copy_(packed)
                packed = held
        setattr(module, self.name, packed)
        self._source, self._stack = source, stack.detach()
        self._packed_from = _source(source)
        return packed.numel() * packed.element_size()

    def pack_matrix(self, module: nn.Module, weight: torch.Tensor) -> int:
        """``pack`` of one ``[out, in]`` matrix (a stack of one)."""
        return self.pack(module, weight.unsqueeze(0), weight)

    def refresh(self, module: nn.Module) -> bool:
        """Pack again, in place, where the weight packed from was written in place since (its
        version counter moved, its storage did not); returns whether it did."""
        source, packed_from = self._source, self._packed_from
        if source is None or packed_from is None or source._version == packed_from[1]:
            return False
        copy: torch.Tensor | None = getattr(module, self.name)
        if copy is None or source.data_ptr() != packed_from[0]:
            return False
        assert self._stack is not None
        with torch.no_grad():
            copy.copy_(in_panels(self._stack, copy.shape[-1]))
        self._packed_from = _source(source)
        return True

    def drop(self, module: nn.Module) -> None:
        """Hold no copy."""
        setattr(module, self.name, None)
        self._packed_from = self._source = self._stack = None

    def get(self, module: nn.Module, source: torch.Tensor) -> torch.Tensor | None:
        """The copy while ``source`` holds what it was packed from, else ``None``."""
        copy: torch.Tensor | None = getattr(module, self.name)
        if copy is None or self._packed_from != _source(source):
            return None
        return copy


class PanelCopies:
    """Every ``PanelCopy`` of a model's modules, found once: ``refresh`` packs again, in place,
    each copy whose weight was written in place since it was packed (a check of one version
    counter per copy when none was: about 4 us a step for the 68 copies of ``small``)."""

    def __init__(self, model: nn.Module) -> None:
        self._copies = tuple(
            (module, copy) for module in model.modules() for copy in _copies_of(module)
        )

    def __len__(self) -> int:
        return len(self._copies)

    def refresh(self) -> int:
        """Refresh every copy (``PanelCopy.refresh``); returns how many were packed again."""
        count = 0
        for module, copy in self._copies:  # the version check inlined: this runs every step
            source, packed_from = copy._source, copy._packed_from
            if source is not None and packed_from and source._version != packed_from[1]:
                count += copy.refresh(module)
        return count


def _copies_of(module: nn.Module) -> list[PanelCopy]:
    """The ``PanelCopy`` attributes of ``module``, alone or in a tuple."""
    found = []
    for value in vars(module).values():
        values = value if isinstance(value, tuple) else (value,)
        found += [v for v in values if isinstance(v, PanelCopy)]
    return found


def _source(parameter: torch.Tensor) -> tuple[int, int]:
    """Where ``parameter`` lives and how often it was written (its version counter)."""
    return parameter.data_ptr(), parameter._version


def pack_model(model: nn.Module) -> int:
    """Pack every module of ``model`` with a ``pack_panels`` method when this process runs torch
    on one thread (the only case that reads the copies); returns the bytes the copies hold."""
    if torch.get_num_threads() != 1:
        return 0
    total = 0
    for module in model.modules():
        pack = getattr(module, "pack_panels", None)
        if callable(pack):
            total += pack()
    return total
