"""The seam between the engine (host-side scheduling and sampling) and whatever runs the model.

Three things cross it: the engine hands an executor one step of work as ``ScheduledChunk``s plus
their token ids and gets back one row of logits per chunk; the executor tells the engine its
``EngineLimits`` once. The engine never touches tensors of the model or the cache. A
``ModelRunner`` satisfies ``StepExecutor``; so do the recording executor of ``runners.measure``
and the deterministic reference executor of the engine tests.

Contract, for every ``execute(chunks, token_ids)`` call the engine makes (``limits`` being the
executor's ``EngineLimits``):
- ``1 <= len(chunks) <= max_rows``; rows are distinct and in ``0 .. max_rows-1``; a row is held by
  one live request from its first chunk to its last (the executor may keep per-row state). A
  preempted request starts again as a new sequence (at position 0, or where a prefix-cache hit
  ends), possibly in another row and through other blocks.
- ``len(token_ids[i]) == chunks[i].num_tokens``; every id is in ``0 .. vocab_size-1``; the total
  number of tokens is at most ``max_num_tokens``.
- chunk ``i`` feeds the tokens at positions ``start_position .. start_position+num_tokens-1`` of
  its request; every earlier position was fed by earlier calls, through the same leading
  ``block_ids`` (a request's block list only grows while it lives), which cover every position
  fed; block ids are in ``0 .. num_blocks-1``. The earlier calls fed the request itself, or
  (a prefix-cache hit, with ``prefix_boundary`` set: then ``start_position`` is a multiple of it
  and this is the request's first chunk) other requests whose tokens before ``start_position``
  are the request's. A block all of whose positions are more than ``lookback - 1`` before
  ``start_position`` is never read again: the engine may have freed it (its id then stands for
  nothing, and may be any valid id).
- ``entry_block_ids`` likewise cover the request's compressed entries: ``ceil(e / block_size)``
  blocks for its ``e = (start_position + num_tokens) // entry_rate`` complete entries, never
  released while it runs (preemption frees them, as it frees its blocks); ids are in
  ``0 .. num_entry_blocks-1``.
- A block or entry block a chunk writes into is held by its request alone. Other live requests
  may hold (and read) the blocks before a prefix-cache hit's end, which no chunk writes again.
- The executor writes the KV of every fed token and returns float32 logits ``[len(chunks),
  vocab_size]``: row ``i`` is the next-token distribution after the LAST token of chunk ``i``.
  A sampled row holding NaN or inf fails its request alone (``FinishReason.ERROR``).
- If ``execute`` raises, the engine advances no request, so later calls feed those positions again
  (through the same blocks); rewriting a position must be harmless (it is for a paged KV cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from typing_extensions import Protocol

from runners.engine.errors import EngineConfigError

__all__ = ["EngineLimits", "ScheduledChunk", "StepExecutor"]


@attrs.frozen(kw_only=True)
class ScheduledChunk:
    """Host-side description of one request's tokens in this step."""

    row: int
    """Block-table row that holds this request (stable while the request lives)."""
    block_ids: tuple[int, ...]
    """Cache blocks owned by the request, in order; must cover every position written."""
    start_position: int
    """Position of the first token of this chunk (= tokens already in the cache)."""
    num_tokens: int = attrs.field(validator=attrs.validators.gt(0))
    entry_block_ids: tuple[int, ...] = attrs.field(
        default=attrs.Factory(lambda chunk: chunk.block_ids, takes_self=True)
    )
    """Entry blocks owned by the request, in order (default: ``block_ids``, which serve when
    the entry pool is at least as large as the block pool and nothing was freed)."""


def _positive(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"EngineLimits.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineLimits:
    """What an executor can take: the sizes the engine schedules within (each an int >= 1)."""

    max_rows: int = attrs.field(validator=_positive)
    """Block-table rows, i.e. the most requests alive in the cache at once."""
    max_num_tokens: int = attrs.field(validator=_positive)
    """The most tokens (summed over chunks) one ``execute`` call accepts."""
    num_blocks: int = attrs.field(validator=_positive)
    """KV-cache blocks in total, ids ``0 .. num_blocks-1``."""
    block_size: int = attrs.field(validator=_positive)
    """Tokens per KV-cache block."""
    max_blocks_per_row: int = attrs.field(validator=_positive)
    """Blocks one row can address."""
    vocab_size: int = attrs.field(validator=_positive)
    """Size of the vocabulary (the width of the logits)."""
    num_entry_blocks: int = attrs.field(
        default=attrs.Factory(lambda limits: limits.num_blocks, takes_self=True),
        validator=_positive,
    )
    """Entry-pool blocks in total (compressed entries), ids ``0 .. num_entry_blocks-1``."""
    entry_rate: int = attrs.field(default=1, validator=_positive)
    """Positions per entry slot (the model's finest compression rate)."""
    lookback: int | None = attrs.field(default=None)
    """Positions ending at a query that its layers read from the block pool; ``None``: every
    earlier position may be read, so no block is freed while its request lives."""
    max_model_len: int | None = attrs.field(default=None)
    """The longest request in tokens when shorter than a row's blocks hold (``None``: they
    bound it)."""
    prefix_boundary: int | None = attrs.field(default=None)
    """Where a request's cache may be shared (``runners.engine.prefix_cache``): at a multiple
    ``P`` of it, every block of either pool a request holds for its positions before ``P`` is
    complete and no position or entry from ``P`` on is written into one of them. A multiple of
    ``block_size * entry_rate``; ``None``: the executor's caches cannot be shared (no prefix
    caching)."""

    def __attrs_post_init__(self) -> None:
        unit = self.block_size * self.entry_rate
        boundary = self.prefix_boundary
        if boundary is not None and (
            isinstance(boundary, bool)
            or not isinstance(boundary, int)
            or boundary < 1
            or boundary % unit
        ):
            raise EngineConfigError(
                f"EngineLimits.prefix_boundary must be a positive multiple of block_size * "
                f"entry_rate = {unit}, got {boundary!r}"
            )

    @property
    def max_context(self) -> int:
        """The longest request, in tokens."""
        addressable = self.max_blocks_per_row * self.block_size
        return addressable if self.max_model_len is None else min(addressable, self.max_model_len)


class StepExecutor(Protocol):
    """Runs one step of scheduled chunks and returns the logits of each chunk's last token."""

    @property
    def limits(self) -> EngineLimits:
        """The sizes the engine must stay within (read once, when an engine is built)."""

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Feed the chunks' tokens; return fp32 logits ``[len(chunks), vocab_size]``."""
