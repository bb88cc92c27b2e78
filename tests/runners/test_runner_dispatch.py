"""Runner mechanics: capture order, dispatch keys, padding, eager fallback, the forward context,
ownership of caches, and one clear error for each kind of bad input."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch

from graphs import NarrowRegion, WideRegion, get_forward_context
from graphs.forward_context import ForwardContext
from platforms import CudaPlatform, PlatformUnavailableError
from runners import (
    CaptureSizeError,
    CUDAGraphMode,
    ModelRunner,
    ModelRunnerV1,
    ModelRunnerV2,
    RunnerInputError,
)
from runners.batch import GraphKey, StepReach
from runners.engine import EngineLimits, ScheduledChunk
from tests.runners.support import (
    LAYOUT,
    captured_sizes,
    fresh_model,
    greedy,
    resolve_on,
    tiny_runner,
)

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE


@functools.cache
def eager_runner() -> ModelRunner:
    return tiny_runner(resolve_on(runner="v2", mode="NONE"))


def chunk(row: int, start: int, count: int) -> ScheduledChunk:
    return ScheduledChunk(
        row=row, block_ids=(2 * row, 2 * row + 1), start_position=start, num_tokens=count
    )


def run(
    runner: ModelRunner, steps: Sequence[Sequence[tuple[ScheduledChunk, list[int]]]]
) -> list[torch.Tensor]:
    return [runner.execute([c for c, _ in step], [ids for _, ids in step]) for step in steps]


# Rows 0 and 1: a 3-token prefill (padded to 4), a 6-token prefill (eager above the largest
# size 4), then two uniform-decode steps of two requests (size 2, FULL where allowed).
STEPS = [
    [(chunk(0, 0, 3), [11, 12, 13])],
    [(chunk(1, 0, 6), [21, 22, 23, 24, 25, 26])],
    [(chunk(0, 3, 1), [14]), (chunk(1, 6, 1), [27])],
    [(chunk(0, 4, 1), [15]), (chunk(1, 7, 1), [28])],
]


def test_capture_runs_largest_context_and_size_first_with_one_break_per_attention_layer() -> None:
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"), capture_sizes=(1, 2))
    runner.capture()
    # buckets of 8, 16 and 32 tokens: 2, 4 and 8 blocks of 4, the largest first
    assert runner.context_buckets.widths == (2, 4, 8)
    # one token is a uniform decode batch (FULL): no mixed batch replays PIECEWISE at size 1
    per_bucket = ((FULL, 2), (PIECEWISE, 2), (FULL, 1))
    assert runner.captured == tuple(
        GraphKey(mode, size, width) for width in (8, 4, 2) for mode, size in per_bucket
    )
    layers = len(runner.model.attention_layers())
    graphs = [runner._graphs[key] for key in runner.captured]
    assert all(g.capture.layout == "G" for g in graphs if g.key.mode is FULL)
    assert all(g.capture.num_eager_breaks == layers for g in graphs if g.key.mode is PIECEWISE)
    assert runner.num_graphs == 3 * (2 + (layers + 1))
    assert runner.num_eager_breaks == 3 * layers


def test_piecewise_decode_graphs_are_captured_at_one_token() -> None:
    """Where decode batches replay PIECEWISE too, one token is a size PIECEWISE serves."""
    runner = tiny_runner(resolve_on(runner="v2", mode="PIECEWISE"), capture_sizes=(1, 2))
    runner.capture()
    assert {(key.mode, key.num_tokens) for key in runner.captured} == {
        (PIECEWISE, 2),
        (PIECEWISE, 1),
    }


def test_graphs_are_held_for_at_most_max_graph_contexts_buckets() -> None:
    runner = tiny_runner(
        resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"),
        capture_sizes=(1, 2),
        max_graph_contexts=2,
    )
    runner.capture()  # ahead of time: the two smallest buckets, the larger first
    assert [key.width for key in runner.captured] == [4] * 3 + [2] * 3
    eager = tiny_runner(resolve_on(runner="v2", mode="NONE"))
    # A request growing past 16 tokens steps into the third bucket: it runs eagerly there, at
    # its exact width, and nothing more is captured.
    prompt = list(range(30, 50))
    first = [ScheduledChunk(row=0, block_ids=tuple(range(8)), start_position=0, num_tokens=16)]
    for r in (runner, eager):
        r.execute(first, [prompt[:16]])
    later = [ScheduledChunk(row=0, block_ids=tuple(range(8)), start_position=16, num_tokens=2)]
    got, expected = runner.execute(later, [prompt[16:18]]), eager.execute(later, [prompt[16:18]])
    assert float((got - expected).abs().max()) <= 1e-5
    assert [key.width for key in runner.captured] == [4] * 3 + [2] * 3


def test_dispatch_pads_captures_on_demand_and_runs_eagerly_above_the_largest_size() -> None:
    seen: list[ForwardContext] = []
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"))
    runner.model.register_forward_pre_hook(lambda *_: seen.append(get_forward_context()))
    eager = tiny_runner(resolve_on(runner="v2", mode="NONE"))
    got, expected = run(runner, STEPS), run(eager, STEPS)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and float((g - e).abs().max()) <= 1e-5
    # A lazy capture takes every missing larger size of its mode first (largest first, as
    # ahead-of-time capture does), so smaller graphs reuse the pool memory of larger ones.
    assert captured_sizes(runner) == ((PIECEWISE, 4), (FULL, 4), (FULL, 2))
    # The model ran forward twice per capture, a warm-up then the capture, as on CUDA (PIECEWISE
    # 4, FULL 4, FULL 2), each with a context of its own, and once for the eager 6-token step;
    # replays do not call it. Every forward got the runner's caches and region.
    assert [c.attn_metadata.num_tokens for c in seen] == [4, 4, 6, 4, 4, 2, 2]
    assert len({id(c) for c in seen}) == len(seen)
    assert all(c.kv_caches is runner.kv_caches for c in seen)
    assert all(c.eager_region == runner.eager_region == NarrowRegion() for c in seen)
    # The last step wrote two tokens into the persistent metadata; nothing else is live.
    assert runner.metadata_buffers.slot_mapping[:2].ge(0).all()  # type: ignore[attr-defined]
    run(runner, STEPS[:1])
    assert runner.metadata_buffers.slot_mapping[3].item() == -1  # type: ignore[attr-defined]


def test_capture_within_the_reach_of_known_requests_takes_only_what_they_replay() -> None:
    """Prompts of 13 and 6 tokens, 2 new tokens each: steps reach 14 positions (the 16-token
    bucket; blocks of 4), decode 2 requests at most (FULL 1 and 2), carry at most 21 tokens
    (every PIECEWISE size). Generating them then captures nothing more."""
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"))
    batch = [list(range(40, 53)), [7, 7, 7, 9, 9, 9]]
    runner.capture(reach=StepReach.of_requests([len(p) for p in batch], 2))
    per_width = [(PIECEWISE, 4), (FULL, 2), (PIECEWISE, 2), (FULL, 1)]
    assert [(k.mode, k.num_tokens, k.width) for k in runner.captured] == [
        *((mode, size, 4) for mode, size in per_width),
        *((mode, size, 2) for mode, size in per_width),
    ]
    captured = runner.captured
    eager = tiny_runner(resolve_on(runner="v2", mode="NONE"))
    assert greedy(runner, batch, 2).tokens == greedy(eager, batch, 2).tokens
    assert runner.captured == captured


def test_full_graphs_serve_only_uniform_decode_batches() -> None:
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_DECODE_ONLY"))
    run(runner, STEPS)
    # mixed batches ran eagerly, never under FULL; size 4 is captured before size 2
    assert captured_sizes(runner) == ((FULL, 4), (FULL, 2))
    with pytest.raises(ValueError, match="uniform-decode batches only"):
        ModelRunnerV2(
            fresh_model(),
            platform=runner.platform,
            layout=LAYOUT,
            eager_region=NarrowRegion(),
            mixed_mode=FULL,
        )
    with pytest.raises(ValueError, match="must be NONE, PIECEWISE or FULL"):
        ModelRunnerV1(
            fresh_model(),
            platform=runner.platform,
            layout=LAYOUT,
            eager_region=WideRegion(),
            decode_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        )


def test_capture_writes_nothing_into_the_caches_and_recapture_is_exact() -> None:
    runner = tiny_runner(resolve_on(runner="v1", mode="PIECEWISE"), capture_sizes=(2, 4))
    # Every cache tensor's last row is the write sink padded tokens write into (dsv4.paging).
    before = [t[:-1].clone() for t in runner.kv_caches.tensors()]
    runner.capture()
    after = [t[:-1] for t in runner.kv_caches.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    first = run(runner, STEPS)
    runner.clear_graphs()
    assert runner.captured == ()
    # Feeding the same positions again through graphs captured anew (with dummy metadata, over
    # caches that now hold data) gives the same logits.
    again = run(runner, STEPS)
    assert captured_sizes(runner) == ((PIECEWISE, 4), (PIECEWISE, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_runner_owns_its_caches_region_and_limits() -> None:
    resolution = resolve_on(runner="v1", mode="PIECEWISE")
    runner = tiny_runner(resolution)
    assert runner.eager_region == resolution.eager_region == WideRegion()
    static = runner.static_memory
    for tensor in (runner.input_ids, runner.positions, *runner.kv_caches.tensors()):
        assert tensor in static
    assert next(runner.model.parameters()) in static
    assert runner.limits == EngineLimits(
        max_rows=4,
        max_num_tokens=16,
        num_blocks=48,
        block_size=4,
        max_blocks_per_row=8,
        vocab_size=runner.model.config.vocab_size,
        num_entry_blocks=48,
        entry_rate=4,  # the CSA layer's rate
        lookback=16,  # the HCA layer's pooling span (rate 16); CSA spans 8, the window 8
        prefix_boundary=16,  # lcm(4-token blocks x entry rate 4, rates 4 and 16)
    )


@pytest.mark.parametrize(
    ("chunks", "ids", "pattern"),
    [
        ([], [], "at least one scheduled chunk"),
        ([chunk(0, 0, 2)], [[1]], "row 0: 1 token ids for 2"),
        ([chunk(0, 0, 1)], [[1], [2]], "2 token-id lists for 1 chunks"),
        ([chunk(0, 0, 1), chunk(0, 1, 1)], [[1], [2]], "rows repeat"),
        ([chunk(9, 0, 1)], [[1]], "row 9 is outside 0..3"),
        (
            [ScheduledChunk(row=0, block_ids=(99,), start_position=0, num_tokens=1)],
            [[1]],
            r"row 0: 1 block ids outside 0..47 \(first: 99\)",
        ),
        (
            [
                ScheduledChunk(
                    row=0, block_ids=(1,), start_position=0, num_tokens=1, entry_block_ids=(48,)
                )
            ],
            [[1]],
            r"row 0: 1 entry block ids outside 0..47 \(first: 48\)",
        ),
        ([chunk(0, 0, 1)], [[320]], "token ids outside 0..319"),
        (
            [chunk(0, 0, 8), chunk(1, 0, 8), chunk(2, 0, 1)],
            [[1] * 8, [1] * 8, [1]],
            "17 tokens exceed",
        ),
    ],
)
def test_bad_steps_give_one_clear_error_each(
    chunks: list[ScheduledChunk], ids: list[list[int]], pattern: str
) -> None:
    runner = eager_runner()
    with pytest.raises(RunnerInputError, match=pattern) as info:
        runner.execute(chunks, ids)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sizes", [(0,), (1, -2), (1, 64)])
def test_bad_capture_sizes_are_refused_at_construction(sizes: tuple[int, ...]) -> None:
    with pytest.raises(CaptureSizeError, match="capture size"):
        tiny_runner(resolve_on(runner="v2"), capture_sizes=sizes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_platform_missing_here_is_refused_unless_simulated() -> None:
    with pytest.raises(PlatformUnavailableError, match="simulate"):
        ModelRunnerV2(
            fresh_model(), platform=CudaPlatform(), layout=LAYOUT, eager_region=NarrowRegion()
        )
