"""The ``out=`` overload of a functional ATen operator, found from the operators' schemas alone.

An operator ``f(a, b) -> Tensor`` usually has an overload ``f.out(a, b, *, Tensor(a!) out)``
tagged ``out``, but not always under that name (``pow``, ``le``, ``where``, ``softmax.int`` and
``index`` name theirs otherwise), so the overload is found by its schema: written arguments
that are all keyword-only (``out=``), one per result of the functional form, and the same
other arguments (name, type and default, in order). Only public schema attributes are read,
so this works on every torch the package supports (``torch._library._out_variant``, which
does the same, is private and absent from torch 2.11).
"""

from __future__ import annotations

import torch

__all__ = ["out_names", "out_variant"]


def _written(argument: torch._C.Argument) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _read(schema: torch._C.FunctionSchema) -> list[tuple[str, str, object]]:
    """The arguments ``schema`` does not write: (name, type, default), in order."""
    return [(a.name, str(a.type), a.default_value) for a in schema.arguments if not _written(a)]


def out_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s ``out=`` overload, or ``None`` where ``op`` writes an argument (or its name ends
    in ``_``: an in-place form) or no overload of its packet matches."""
    schema = op._schema
    if schema.name.endswith("_") or any(_written(a) for a in schema.arguments):
        return None
    reads = _read(schema)
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        written = [a for a in candidate._schema.arguments if _written(a)]
        if not written or not all(a.kwarg_only for a in written):
            continue  # not an out= form (torch 2.11 has no ``out`` tag to say so)
        if len(written) == len(schema.returns) and _read(candidate._schema) == reads:
            return candidate
    return None


def out_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The names of the arguments ``op`` writes (an ``out=`` overload's outputs), in order."""
    return tuple(a.name for a in op._schema.arguments if _written(a))
