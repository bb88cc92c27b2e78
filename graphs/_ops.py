"""The ATen-op vocabulary every dispatch mode of ``graphs`` shares, each word defined once.

A dispatch mode here sees every op the program issues (the tape's recorder, the capture audit,
the allocation tracker, the CUDA backend's segment watch) and asks the same questions of each:
its short name, whether it turns a literal into a tensor, whether its output is shaped after a
tensor argument without reading its data, which arguments it writes.

Invariant: every answer depends on the overload alone (never on argument values), so it is read
from the schema once per overload and cached: capture asks it of ~1000 ops per graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LITERALS", "QuietDispatchMode", "arguments", "is_like_factory", "op_name"]

LITERALS = frozenset({"lift_fresh", "lift", "lift_fresh_copy"})
"""Ops that turn a ``torch.tensor`` literal into a tensor: their output is a new allocation even
though it may share its input's storage."""


@functools.cache
def op_name(func: torch._ops.OpOverload) -> str:
    """``func``'s name without namespace or overload (``aten::add.Tensor`` is ``add``)."""
    return func._schema.name.split("::")[-1]


def is_like_factory(name: str) -> bool:
    """``new_*`` and ``*_like``: outputs shaped after a tensor argument, not made of its data."""
    return name.startswith("new_") or name.endswith("_like")


@functools.cache
def _slots(func: torch._ops.OpOverload) -> tuple[tuple[int, str, bool, bool], ...]:
    """(position, name, keyword-only, written) of each schema argument."""
    return tuple(
        (
            position,
            argument.name,
            argument.kwarg_only,
            argument.alias_info is not None and argument.alias_info.is_write,
        )
        for position, argument in enumerate(func._schema.arguments)
    )


def arguments(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[Any, bool]]:
    """Each argument passed to ``func``, as passed, and whether its schema marks it written
    (``Tensor(a!)``); arguments left to their defaults are skipped."""
    for position, name, kwarg_only, written in _slots(func):
        if name in kwargs:
            yield kwargs[name], written
        elif position < len(args) and not kwarg_only:
            yield args[position], written


class QuietDispatchMode(TorchDispatchMode):
    """A dispatch mode that torch runs as it is: subclasses implement ``dispatch``.

    Torch would wrap ``__torch_dispatch__`` to skip dynamo, importing dynamo (seconds) for a mode
    that never runs under ``torch.compile``; this base tells it not to.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.dispatch(func, args, kwargs or {})

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``func`` (or not) and return its result, as ``__torch_dispatch__`` would."""
        raise NotImplementedError
