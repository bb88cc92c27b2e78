"""The attention layer's region: identical under every strategy, capturable prepare and attend.

- Eagerly, one layer composed with each of the four strategies (named by the forward context)
  gives bitwise identical output; each strategy is composed once per layer, then reused.
- ``_prepare`` and ``_attend`` issue no op the capture legality rules refuse (host syncs,
  data-dependent output shapes, boolean-mask indexing, random ops), and the ops they issue
  (with every shape) depend only on the token count, never on metadata values: checked by
  recording the ATen ops each step dispatches under a strategy that wraps them (the strategy
  is the only way to reach the two steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.attention import DeepseekV4Attention
from dsv4.cache import allocate_kv_caches, entry_rate
from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4.metadata import new_metadata
from dsv4.testing import Chunk, configs, indexer_weights, random_model
from graphs import (
    STRATEGIES,
    CaptureError,
    EagerRegionStrategy,
    ForwardContext,
    NoGraph,
    forward_context,
)
from graphs.tape.legality import check_capturable

BLOCK = 4


def _run_layer(
    config: DeepseekV4Config,
    strategy: EagerRegionStrategy,
    chunks: list[Chunk],
    hidden: torch.Tensor,
    layer: int,
    seed: int,
    indexer: str = "random",
) -> torch.Tensor:
    """Output of attention layer ``layer`` for one step on fresh (zeroed) caches."""
    attention = random_model(config, seed, indexer=indexer).attention_layers()[layer]
    caches = allocate_kv_caches(config, num_blocks=32, block_size=BLOCK)
    metadata, positions = new_metadata(
        chunks,
        num_tokens=hidden.shape[0],
        block_size=BLOCK,
        max_rows=4,
        max_blocks=8,
        entry_rate=entry_rate(config),
    )
    context = ForwardContext(attn_metadata=metadata, kv_caches=caches, eager_region=strategy)
    with torch.inference_mode(), forward_context(context):
        return attention(positions, hidden)


def _chunks(starts: list[int], sizes: list[int]) -> list[Chunk]:
    return [
        Chunk(
            row=i,
            block_ids=tuple(range(8 * i, 8 * i + 8)),
            entry_block_ids=tuple(range(8 * i, 8 * i + 8)),
            start_position=s,
            num_tokens=n,
        )
        for i, (s, n) in enumerate(zip(starts, sizes, strict=True))
    ]


@settings(max_examples=15)
@given(
    config=configs(max_layers=3),
    layer_pick=st.integers(0, 2),
    starts=st.lists(st.integers(0, 20), min_size=1, max_size=3),
    indexer=indexer_weights,
    data=st.data(),
)
def test_every_strategy_gives_bitwise_identical_output(
    config: DeepseekV4Config,
    layer_pick: int,
    starts: list[int],
    indexer: str,
    data: st.DataObject,
) -> None:
    sizes = [data.draw(st.integers(1, 32 - s)) for s in starts]
    tokens = sum(sizes) + 2  # two padded tokens
    hidden = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = layer_pick % config.num_hidden_layers
    chunks = _chunks(starts, sizes)
    outputs = [_run_layer(config, s, chunks, hidden, layer, 3, indexer) for s in STRATEGIES]
    for output in outputs[1:]:
        assert torch.equal(output, outputs[0])


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.illegal: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            check_capturable(func, args, kwargs)
        except CaptureError as exc:
            self.illegal.append(str(exc))
        out = func(*args, **kwargs)
        nested = [x for a in args if isinstance(a, list | tuple) for x in a]
        flat = [*args, *nested, *kwargs.values(), out]
        shapes = tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


class _Recording(EagerRegionStrategy):
    """Runs prepare and attend under separate op recorders (test-only strategy)."""

    name = "recording"
    rank = 1
    description = "records the ops of prepare and attend"

    def __init__(self) -> None:
        self.prepare, self.attend = _OpRecorder(), _OpRecorder()

    def compose(
        self, prepare: Callable[..., Any], attend: Callable[[Any], Any]
    ) -> Callable[..., Any]:
        def region(*args: Any, **kwargs: Any) -> Any:
            with self.prepare:
                prepared = prepare(*args, **kwargs)
            with self.attend:
                return attend(prepared)

        return region


@pytest.mark.parametrize("layer_type", [SLIDING, CSA, HCA])
def test_prepare_and_attend_are_sync_free_and_static(layer_type: str) -> None:
    config = DeepseekV4Config.tiny()
    layer = config.layer_types.index(layer_type)
    hidden = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(2))
    traces = []
    for starts, sizes in (([0], [6]), ([17, 3], [1, 4]), ([30, 0, 9], [2, 2, 1])):
        recording = _Recording()
        _run_layer(config, recording, _chunks(starts, sizes), hidden, layer, 5)
        assert recording.prepare.illegal == [] and recording.attend.illegal == []
        assert recording.prepare.ops and recording.attend.ops
        traces.append((recording.prepare.ops, recording.attend.ops))
    assert all(trace == traces[0] for trace in traces[1:])


def test_each_strategy_is_composed_once_per_layer() -> None:
    config = DeepseekV4Config.tiny()
    attention = random_model(config, 0).attention_layers()[0]
    caches = allocate_kv_caches(config, num_blocks=8, block_size=BLOCK)
    metadata, positions = new_metadata(
        _chunks([0], [2]),
        num_tokens=2,
        block_size=BLOCK,
        max_rows=1,
        max_blocks=8,
        entry_rate=entry_rate(config),
    )
    hidden = torch.zeros(2, config.hidden_size)
    composed: list[str] = []

    class Counting(NoGraph):
        def compose(
            self, prepare: Callable[..., Any], attend: Callable[[Any], Any]
        ) -> Callable[..., Any]:
            composed.append(self.name)
            return super().compose(prepare, attend)

    for strategy in (Counting(), *STRATEGIES, Counting(), *STRATEGIES):
        context = ForwardContext(attn_metadata=metadata, kv_caches=caches, eager_region=strategy)
        with torch.inference_mode(), forward_context(context):
            attention(positions, hidden)
    assert composed == ["no-graph"]


def test_attention_without_caches_or_context_fails_clearly() -> None:
    config = DeepseekV4Config.tiny()
    attention = DeepseekV4Attention(config, 0)
    hidden, positions = torch.zeros(2, config.hidden_size), torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no forward context"):
        attention(positions, hidden)
    metadata, positions = new_metadata(
        _chunks([0], [2]),
        num_tokens=2,
        block_size=BLOCK,
        max_rows=1,
        max_blocks=8,
        entry_rate=entry_rate(config),
    )
    context = forward_context(ForwardContext(attn_metadata=metadata))
    with context, pytest.raises(RuntimeError, match=r"carries no KV caches: pass ForwardContext"):
        attention(positions, hidden)
