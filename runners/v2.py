"""``ModelRunnerV2``: attention metadata rewritten in place into persistent buffers.

The buffers are allocated once, written at capture (with dummy all-padding metadata) and
rewritten in place before every step, so captured work that reads them reads the current step's
metadata on replay. V2 therefore requires no eager region of its own (``FullGraph``): the graph
mode alone decides.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

import torch

from dsv4.metadata import AttentionMetadata, MetadataBuffers
from graphs.strategies import EagerRegionStrategy, FullGraph
from runners.base import ModelRunner
from runners.engine.executor import ScheduledChunk

__all__ = ["ModelRunnerV2"]


class ModelRunnerV2(ModelRunner):
    """The newer runner: address-stable metadata buffers; requires nothing beyond the mode."""

    name: ClassVar[str] = "v2"
    eager_region_strategy: ClassVar[EagerRegionStrategy] = FullGraph()
    eager_region_reason: ClassVar[str] = (
        "ModelRunnerV2 rewrites attention metadata in place into persistent buffers, also at "
        "capture, so metadata-dependent work may be captured"
    )

    @functools.cached_property
    def metadata_buffers(self) -> MetadataBuffers:
        """The persistent metadata buffers, sized to the token budget (allocated once)."""
        return MetadataBuffers(
            max_tokens=self.max_num_tokens,
            block_size=self.layout.block_size,
            max_rows=self.layout.max_rows,
            max_blocks=self.layout.max_blocks_per_row,
            entry_rate=self.entry_rate,
            device=self.device,
        )

    def _write_metadata(
        self, chunks: Sequence[ScheduledChunk], num_tokens: int, width: int
    ) -> AttentionMetadata:
        return self.metadata_buffers.write(
            chunks, num_tokens=num_tokens, positions_out=self.positions, width=width
        )

    def _static_metadata(self) -> dict[str, torch.Tensor]:
        buffers = self.metadata_buffers
        return {
            "metadata.token_request": buffers.token_request,
            "metadata.slot_mapping": buffers.slot_mapping,
            "metadata.block_table": buffers.block_table,
            "metadata.entry_table": buffers.entry_table,
        }
