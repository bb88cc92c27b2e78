"""The model under breakable capture on the CPU tape: replayed steps equal eager steps.

A step is captured once, on an all-padding batch (which writes nothing), then replayed for real
decode and mixed steps whose inputs and metadata are rewritten in place; the logits must equal
an eager run of the same schedule. FULL graphs work because attend has no host sync on any
path; the narrow region reads metadata inside the graph, so it needs address-stable metadata
(persistent buffers) and the audit refuses fresh per-step tensors; the wide region works with
fresh metadata because the whole region reads the forward context when it runs.
"""

from __future__ import annotations

import pytest
import torch

import dsv4.attention
from dsv4.cache import allocate_kv_caches, entry_rate
from dsv4.config import DeepseekV4Config
from dsv4.metadata import AttentionMetadata, MetadataBuffers, new_metadata
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.testing import Chunk, chunk_schedule, random_model, run_schedule
from graphs import (
    BreakableCapture,
    CaptureAuditError,
    EagerRegionStrategy,
    ForwardContext,
    FullGraph,
    NarrowRegion,
    WideRegion,
    forward_context,
)
from graphs.static_memory import StaticMemory

ENTRY_RATE = entry_rate(DeepseekV4Config.tiny())
"""Entry rate of the tiny config (its entries share the window blocks' ids: never too few)."""

BLOCK, MAX_BLOCKS, TOKENS = 4, 8, 4
PROMPTS = [list(range(3, 16)), list(range(40, 61))]
CHUNKS = [[2, 2, 1, 2, 1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1]]


class _Harness:
    """A model with static inputs, caches, (optionally persistent) metadata and a region."""

    def __init__(
        self, model: DeepseekV4ForCausalLM, persistent: bool, region: EagerRegionStrategy
    ) -> None:
        self.model = model
        self.region = region
        self.caches = allocate_kv_caches(model.config, num_blocks=16, block_size=BLOCK)
        self.buffers = MetadataBuffers(
            max_tokens=TOKENS,
            block_size=BLOCK,
            max_rows=2,
            max_blocks=MAX_BLOCKS,
            entry_rate=ENTRY_RATE,
        )
        self.persistent = persistent
        self.ids = torch.zeros(TOKENS, dtype=torch.long)
        self.positions = torch.zeros(TOKENS, dtype=torch.long)
        self.static = StaticMemory()
        self.static.register_module(model)
        self.static.register_many(self.caches.tensors(), "kv_cache")
        self.static.register_many([self.ids, self.positions], "inputs")
        if persistent:
            self.static.register_many(self.buffers.tensors(), "metadata")

    def context(self, chunks: list[Chunk]) -> ForwardContext:
        """The step's context: its metadata (written in place or fresh), caches and region."""
        return ForwardContext(
            attn_metadata=self.metadata(chunks), kv_caches=self.caches, eager_region=self.region
        )

    def metadata(self, chunks: list[Chunk]) -> AttentionMetadata:
        if self.persistent:
            return self.buffers.write(chunks, num_tokens=TOKENS, positions_out=self.positions)
        metadata, positions = new_metadata(
            chunks,
            num_tokens=TOKENS,
            block_size=BLOCK,
            max_rows=2,
            max_blocks=MAX_BLOCKS,
            entry_rate=ENTRY_RATE,
        )
        self.positions.copy_(positions)
        return metadata

    def capture(self, full: bool) -> tuple[BreakableCapture, torch.Tensor]:
        context = self.context([])
        capture = BreakableCapture(device="cpu", full=full, static=self.static)
        with torch.inference_mode(), forward_context(context), capture:
            logits = self.model(self.ids, self.positions)
        return capture, logits

    def replay_schedule(
        self, capture: BreakableCapture, logits: torch.Tensor
    ) -> list[torch.Tensor]:
        done, outputs = [0, 0], [[], []]
        blocks = [tuple(range(0, 8)), tuple(range(8, 16))]
        for step in chunk_schedule(CHUNKS):
            chunks, ids = [], []
            for request, count in step:
                chunks.append(
                    Chunk(
                        row=request,
                        block_ids=blocks[request],
                        entry_block_ids=blocks[request],
                        start_position=done[request],
                        num_tokens=count,
                    )
                )
                ids += PROMPTS[request][done[request] : done[request] + count]
                done[request] += count
            context = self.context(chunks)
            self.ids.copy_(torch.tensor(ids + [0] * (TOKENS - len(ids))))
            with torch.inference_mode(), forward_context(context):
                capture.replay()
            offset = 0
            for request, count in step:
                outputs[request].append(logits[offset : offset + count].clone())
                offset += count
        return [torch.cat(parts) for parts in outputs]


def _eager_reference(config: DeepseekV4Config) -> list[torch.Tensor]:
    return run_schedule(random_model(config, 11), PROMPTS, chunk_schedule(CHUNKS), block_size=BLOCK)


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [(FullGraph(), "G"), (NarrowRegion(), "GEGEGEG"), (WideRegion(), "GEGEGEG")],
)
def test_replay_with_persistent_metadata_equals_eager(
    strategy: EagerRegionStrategy, layout: str
) -> None:
    config = DeepseekV4Config.tiny()
    harness = _Harness(random_model(config, 11), persistent=True, region=strategy)
    capture, logits = harness.capture(full=strategy == FullGraph())
    assert capture.layout == layout
    replayed = harness.replay_schedule(capture, logits)
    for ours, expected in zip(replayed, _eager_reference(config), strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_narrow_region_refuses_fresh_metadata_and_wide_region_replays_it() -> None:
    config = DeepseekV4Config.tiny()
    narrow = _Harness(random_model(config, 11), persistent=False, region=NarrowRegion())
    with pytest.raises(CaptureAuditError):
        narrow.capture(full=False)
    wide = _Harness(random_model(config, 11), persistent=False, region=WideRegion())
    capture, logits = wide.capture(full=False)
    replayed = wide.replay_schedule(capture, logits)
    for ours, expected in zip(replayed, _eager_reference(config), strict=True):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", [FullGraph(), NarrowRegion()], ids=["full", "narrow"])
def test_attending_in_slices_replays_the_eager_logits(
    strategy: EagerRegionStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queries attended one at a time (``ATTEND_CHUNK`` = 1): each slice writes a view of the
    preallocated output, inside the graph (FULL, as a CUDA graph would record it) or in an
    eager break (narrow). Replays equal eager steps that attend every query at once, with the
    audit raising on any unstable address."""
    config = DeepseekV4Config.tiny()
    expected = _eager_reference(config)
    monkeypatch.setattr(dsv4.attention, "ATTEND_CHUNK", 1)
    harness = _Harness(random_model(config, 11), persistent=True, region=strategy)
    capture, logits = harness.capture(full=strategy == FullGraph())
    replayed = harness.replay_schedule(capture, logits)
    for ours, reference in zip(replayed, expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
