"""The seam between the engine (host-side scheduling and sampling) and whatever runs the model.

The engine never touches tensors of the model or the cache; it hands an executor one step of work
as ``ScheduledChunk``s plus their token ids and gets back one row of logits per chunk. A
``ModelRunner`` satisfies this protocol; so does the deterministic reference executor of the
engine tests.

Contract, for every ``execute(chunks, token_ids)`` call the engine makes:
- ``1 <= len(chunks) <= max_rows``; rows are distinct and in ``0 .. max_rows-1``; a row is held by
  one live request from its first chunk to its last (the executor may keep per-row state).
- ``len(token_ids[i]) == chunks[i].num_tokens``; every id is in ``0 .. vocab_size-1``; the total
  number of tokens is at most ``max_num_tokens``.
- chunk ``i`` feeds the tokens at positions ``start_position .. start_position+num_tokens-1`` of
  its request; every earlier position was fed by earlier calls, through the same leading
  ``block_ids`` (a request's block list only grows while it lives), which cover every position fed
  and are owned by that request alone; block ids are in ``0 .. num_blocks-1``.
- The executor writes the KV of every fed token and returns float32 logits ``[len(chunks),
  vocab_size]``: row ``i`` is the next-token distribution after the LAST token of chunk ``i``.
  A sampled row holding NaN or inf fails its request alone (``FinishReason.ERROR``).
- If ``execute`` raises, the engine advances no request, so later calls feed those positions again
  (through the same blocks); rewriting a position must be harmless (it is for a paged KV cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import Protocol

from dsv4.metadata import ScheduledChunk

__all__ = ["StepExecutor"]


class StepExecutor(Protocol):
    """Runs one step of scheduled chunks and returns the logits of each chunk's last token."""

    @property
    def max_rows(self) -> int:
        """Block-table rows, i.e. the most requests alive in the cache at once."""

    @property
    def max_num_tokens(self) -> int:
        """The most tokens (summed over chunks) one ``execute`` call accepts."""

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks in total, ids ``0 .. num_blocks-1``."""

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""

    @property
    def max_blocks_per_row(self) -> int:
        """Blocks one row can address; ``max_blocks_per_row * block_size`` is the max context."""

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary (the width of the logits)."""

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Feed the chunks' tokens; return fp32 logits ``[len(chunks), vocab_size]``."""
