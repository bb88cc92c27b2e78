"""Capture sizes and padding: with the graph mode, the dispatch keys of captured graphs.

Invariants:
- A captured graph is keyed by its basic graph mode and its padded token count; a FULL graph
  serves only uniform-decode batches (every request contributes one token), a PIECEWISE graph
  serves any batch of its size.
- Capture sizes are positive, distinct and sorted; a batch of ``n`` tokens is padded to the
  smallest capture size ``>= n`` and runs eagerly when ``n`` exceeds the largest one. Padded
  tokens get slot -1 (they write nothing) and their outputs are never read.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import attrs

from runners.errors import CaptureSizeError

__all__ = ["DEFAULT_CAPTURE_SIZES", "CaptureSizes"]

DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


@attrs.frozen
class CaptureSizes:
    """The validated, ascending token counts a runner captures graphs for."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Iterable[int], *, max_num_tokens: int) -> CaptureSizes:
        """Validate ``sizes``; ``CaptureSizeError`` names the offending value."""
        values = list(sizes)
        if not values:
            raise CaptureSizeError("capture sizes are empty; give at least one positive size")
        for size in values:
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise CaptureSizeError(
                    f"capture size {size!r} is not a positive integer; sizes count tokens"
                )
            if size > max_num_tokens:
                raise CaptureSizeError(
                    f"capture size {size} exceeds the runner's token budget {max_num_tokens}; "
                    "raise max_num_tokens or drop the size"
                )
        return cls(tuple(sorted(set(values))))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def largest_first(self) -> tuple[int, ...]:
        """The capture order: largest first, so smaller graphs reuse the pool's memory."""
        return tuple(reversed(self.sizes))

    def padded(self, num_tokens: int) -> int | None:
        """The smallest capture size ``>= num_tokens``, or ``None`` above the largest."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[index] if index < len(self.sizes) else None
