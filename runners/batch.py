"""Capture sizes, context buckets and padding: with the graph mode, the dispatch keys of
captured graphs.

Invariants:
- A captured graph is keyed by its basic graph mode, its padded token count and its context
  bucket (``GraphKey``); a FULL graph serves only uniform-decode batches (every request
  contributes one token), a PIECEWISE graph serves any batch of its size and bucket.
- Capture sizes are positive, distinct and sorted; a batch of ``n`` tokens is padded to the
  smallest capture size ``>= n`` and runs eagerly when ``n`` exceeds the largest one. Padded
  tokens get slot -1 (they write nothing) and their outputs are never read.
- A step's attention reads the first ``width`` columns of the block table, so its cost follows
  ``width`` and not the configured maximum context. A step needs the blocks that cover the
  furthest position any of its chunks reaches; eager steps use exactly that width, captured
  steps the smallest context bucket that covers it. Buckets are block counts growing
  geometrically (doubling) from the first bucket up to the block table's full width, which is
  always the last bucket, so a graph's width wastes less than half of it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import attrs

from runners.errors import CaptureSizeError
from runners.modes import CUDAGraphMode

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "DEFAULT_FIRST_CONTEXT_BUCKET",
    "CaptureSizes",
    "ContextBuckets",
    "GraphKey",
    "StepReach",
    "blocks_needed",
]

DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
DEFAULT_FIRST_CONTEXT_BUCKET = 512
"""Tokens the first context bucket covers (capped by the maximum context)."""


class GraphKey(NamedTuple):
    """What a captured graph serves: its mode, padded token count and block-table width."""

    mode: CUDAGraphMode
    num_tokens: int
    width: int
    """Block-table columns (context bucket, in blocks) the graph's attention reads."""


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

    def serving(self, num_tokens: int) -> tuple[int, ...]:
        """The sizes a batch of at most ``num_tokens`` tokens is padded to (ascending): every
        size up to the one ``num_tokens`` pads to (FULL graphs serve uniform-decode batches,
        at most one token per request in flight, so a FULL size above that never replays)."""
        padded = self.padded(num_tokens)
        return self.sizes if padded is None else self.sizes[: self.sizes.index(padded) + 1]


@attrs.frozen
class StepReach:
    """How far the steps of a known set of requests can go (``dsv4 run`` knows its prompts and
    ``--max-new-tokens`` before the first step), so a runner captures ahead of time only the
    graphs those steps can replay (``ModelRunner.capture``).

    Invariant: every step the engine schedules for these requests, a preempted request's
    recomputation included, is a uniform decode of at most ``decode_batch`` tokens or a step of
    at most ``step_tokens`` tokens, and reaches no position at or beyond ``positions``."""

    decode_batch: int
    step_tokens: int
    positions: int

    @classmethod
    def of_requests(cls, prompt_lengths: Sequence[int], max_new_tokens: int) -> StepReach:
        """A request's furthest step ends at its prompt plus every new token but the last (the
        last is sampled, never fed back); one step computes at most that much of it (a preempted
        request recomputes what it had generated) or, decoding, one token. (The runner's own
        limits, its rows and token budget, bound the steps further.)"""
        lengths = [length + max_new_tokens - 1 for length in prompt_lengths]
        return cls(decode_batch=len(lengths), step_tokens=sum(lengths), positions=max(lengths))


class _Span(Protocol):
    @property
    def start_position(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


def blocks_needed(chunks: Iterable[_Span], block_size: int) -> int:
    """Blocks covering the furthest position any chunk reaches (at least one)."""
    furthest = max((c.start_position + c.num_tokens for c in chunks), default=1)
    return -(-furthest // block_size)


@attrs.frozen
class ContextBuckets:
    """The ascending block-table widths (in blocks) graphs are captured for."""

    widths: tuple[int, ...]

    @classmethod
    def of(cls, *, max_blocks: int, block_size: int, first_tokens: int) -> ContextBuckets:
        """Widths doubling from the blocks covering ``first_tokens`` up to ``max_blocks``."""
        if max_blocks < 1 or first_tokens < 1:
            raise CaptureSizeError(
                f"context buckets need a positive width, got {max_blocks} blocks and a first "
                f"bucket of {first_tokens} tokens"
            )
        width = min(max_blocks, -(-first_tokens // block_size))
        widths = []
        while width < max_blocks:
            widths.append(width)
            width *= 2
        return cls((*widths, max_blocks))

    @property
    def largest(self) -> int:
        return self.widths[-1]

    def bucket(self, blocks: int) -> int:
        """The smallest width covering ``blocks`` (callers never ask above the largest)."""
        return self.widths[bisect.bisect_left(self.widths, blocks)]
