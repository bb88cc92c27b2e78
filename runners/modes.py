"""Graph modes and their split by batch kind, with names as in the engine the seed is from.

A batch is *uniform decode* when every request contributes exactly one token; every other batch
is *mixed*. Composite modes pick one basic mode (``NONE``, ``PIECEWISE``, ``FULL``) per kind:

    mode                 decode      mixed
    NONE                 NONE        NONE
    PIECEWISE            PIECEWISE   PIECEWISE
    FULL                 FULL        FULL
    FULL_DECODE_ONLY     FULL        NONE
    FULL_AND_PIECEWISE   FULL        PIECEWISE   (the default)

Each basic mode requires an eager region of its own: ``PIECEWISE`` at least ``NarrowRegion``
(the attention core always runs eagerly between pieces), ``FULL`` is ``FullGraph`` (nothing
eager), ``NONE`` is ``NoGraph`` (nothing captured).
"""

from __future__ import annotations

import enum

from graphs.strategies import EagerRegionStrategy, FullGraph, NarrowRegion, NoGraph
from runners.errors import UnknownModeError

__all__ = ["CUDAGraphMode"]


class CUDAGraphMode(enum.Enum):
    """How a step is run: eagerly, as graph pieces around eager breaks, or as one full graph."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @classmethod
    def from_name(cls, name: str) -> CUDAGraphMode:
        """Look a mode up by name (case-insensitive); ``UnknownModeError`` lists the names."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            valid = ", ".join(m.name for m in cls)
            raise UnknownModeError(
                f"unknown cudagraph mode {name!r}; expected one of: {valid}"
            ) from None

    @property
    def is_basic(self) -> bool:
        """True for the three modes a single batch can run under."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    def decode_mode(self) -> CUDAGraphMode:
        """The basic mode for uniform-decode batches."""
        return _SPLIT[self][0]

    def mixed_mode(self) -> CUDAGraphMode:
        """The basic mode for mixed batches (prefill chunks, or prefill and decode together)."""
        return _SPLIT[self][1]

    def mode_for(self, *, uniform_decode: bool) -> CUDAGraphMode:
        return self.decode_mode() if uniform_decode else self.mixed_mode()

    @property
    def required_strategy(self) -> EagerRegionStrategy:
        """The eager region a basic mode needs in the attention layer."""
        if not self.is_basic:
            raise ValueError(f"{self.name} is not a basic mode; ask its decode or mixed mode")
        return _REQUIRED[self][0]

    @property
    def requirement_reason(self) -> str:
        if not self.is_basic:
            raise ValueError(f"{self.name} is not a basic mode; ask its decode or mixed mode")
        return _REQUIRED[self][1]


_SPLIT: dict[CUDAGraphMode, tuple[CUDAGraphMode, CUDAGraphMode]] = {
    CUDAGraphMode.NONE: (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
    CUDAGraphMode.PIECEWISE: (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
    CUDAGraphMode.FULL: (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
    CUDAGraphMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    CUDAGraphMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
}

_REQUIRED: dict[CUDAGraphMode, tuple[EagerRegionStrategy, str]] = {
    CUDAGraphMode.NONE: (NoGraph(), "cudagraph mode NONE captures nothing"),
    CUDAGraphMode.PIECEWISE: (
        NarrowRegion(),
        "PIECEWISE capture runs at least the attention core eagerly between graph pieces",
    ),
    CUDAGraphMode.FULL: (FullGraph(), "FULL capture records the whole forward as one graph"),
}
