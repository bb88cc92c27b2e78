"""Both runners bring a step's metadata to the device the same way: host tensors staged by
``stage_into`` (pinned and non-blocking on a GPU), never a copy from pageable memory, which
drains the stream on a GPU (``torch.tensor(..., device=...)``, ``.to(device)``). V1 still builds
fresh tensors every step (it stays V1: not address-stable; ``test_seed_bug`` shows what that
costs under a narrow region)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dsv4.metadata
from graphs._tensor_refs import storage_key
from runners import ModelRunner
from runners.engine import ScheduledChunk
from tests.runners.support import resolve_on, tiny_runner

CHUNKS = [
    ScheduledChunk(row=0, block_ids=(0, 1), start_position=3, num_tokens=2),
    ScheduledChunk(row=2, block_ids=(4,), start_position=0, num_tokens=1),
]


class _PageableCopies(TorchFunctionMode):
    """The calls that copy host data to a device from pageable memory: a literal or
    ``as_tensor`` given a device, a move to a device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        literal = func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
        move = func is torch.Tensor.to and (
            "device" in kwargs or any(isinstance(a, str | torch.device) for a in args[1:])
        )
        if literal or move:
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


def _metadata(runner: ModelRunner) -> tuple[tuple[torch.Tensor, ...], list[str], list[int]]:
    """One step's metadata tensors (and positions) from ``runner``, the pageable copies the
    step made, and the storages ``stage_into`` wrote."""
    staged: list[int] = []
    stage = dsv4.metadata.stage_into

    def recording(destination: torch.Tensor, host: torch.Tensor) -> None:
        staged.append(storage_key(destination))
        stage(destination, host)

    copies = _PageableCopies()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dsv4.metadata, "stage_into", recording)
        with copies:
            metadata = runner._write_metadata(CHUNKS, 4, 2)
    tensors = (
        metadata.token_request,
        metadata.slot_mapping,
        metadata.block_table,
        metadata.entry_table,
        runner.positions[:4],
    )
    return tensors, copies.calls, staged


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_a_step_stages_its_metadata_and_copies_nothing_from_pageable_memory(name: str) -> None:
    runner = tiny_runner(resolve_on(runner=name, mode="NONE"))
    tensors, pageable, staged = _metadata(runner)
    assert pageable == []
    assert all(storage_key(t) in staged for t in tensors[:4])
    assert runner.positions[:4].tolist() == [3, 4, 0, 0]
    assert tensors[1].tolist() == [3, 4, 16, -1]  # block id * block size (4) + offset


def test_v1_metadata_is_fresh_every_step() -> None:
    runner = tiny_runner(resolve_on(runner="v1", mode="NONE"))
    first, _, _ = _metadata(runner)
    second, _, _ = _metadata(runner)
    for a, b in zip(first[:4], second[:4], strict=True):
        assert storage_key(a) != storage_key(b) and torch.equal(a, b)
