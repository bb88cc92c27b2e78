"""``ModelRunnerV1``: attention metadata built as new tensors every step.

Its metadata is not address-stable: each step (and each capture, with dummy all-padding
metadata) allocates fresh tensors. Captured work that reads metadata would replay against the
capture-time dummy tensors — the seed's bug — so V1 requires the ``WideRegion``: everything that
reads metadata (the attention input preparation and the attention core) runs eagerly and reads
the current step's metadata from the forward context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from dsv4.metadata import AttentionMetadata, new_metadata
from graphs.strategies import EagerRegionStrategy, WideRegion
from runners.base import ModelRunner
from runners.engine.executor import ScheduledChunk

__all__ = ["ModelRunnerV1"]


class ModelRunnerV1(ModelRunner):
    """The older runner: fresh metadata tensors per step; requires the wide eager region."""

    name: ClassVar[str] = "v1"
    eager_region_strategy: ClassVar[EagerRegionStrategy] = WideRegion()
    eager_region_reason: ClassVar[str] = (
        "ModelRunnerV1 rebuilds attention metadata as new tensors every step and uses dummy "
        "metadata at capture, so metadata-dependent work must run eagerly"
    )

    def _write_metadata(
        self, chunks: Sequence[ScheduledChunk], num_tokens: int, width: int
    ) -> AttentionMetadata:
        metadata, positions = new_metadata(
            chunks,
            num_tokens=num_tokens,
            block_size=self.layout.block_size,
            max_rows=self.layout.max_rows,
            max_blocks=width,
            entry_rate=self.entry_rate,
            device=self.device,
        )
        self.positions[:num_tokens].copy_(positions)
        return metadata

    def _static_metadata(self) -> dict[str, torch.Tensor]:
        return {}
