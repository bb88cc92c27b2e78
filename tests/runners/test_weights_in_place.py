"""Weights written in place after capture reach every later step: a CUDA graph reads its
parameters' memory, so a replay after ``load_state_dict`` multiplies the new weights. On one
CPU thread the graphs read copies of the weights in panels (``dsv4.panels``); the runner packs
a copy again, into the buffer its graphs read, whenever its weight was written in place."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dsv4.panels import pack_model
from runners import CUDAGraphMode
from tests.runners.support import (
    fresh_model,
    greedy,
    max_logit_difference,
    resolve_on,
    tiny_runner,
)

BATCH = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]


@pytest.fixture
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the only configuration that packs and reads copies
    yield
    torch.set_num_threads(previous)


def test_weights_loaded_in_place_after_capture_reach_every_replay(one_thread: None) -> None:
    model = fresh_model(seed=0)
    assert pack_model(model) > 0
    runner = tiny_runner(resolve_on(runner="v2", mode="FULL_AND_PIECEWISE"), model=model)
    runner.capture()
    before = greedy(runner, BATCH, 4)
    other = fresh_model(seed=1)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())  # copy_ into every parameter: in place
    after = greedy(runner, BATCH, 4)
    pack_model(other)
    reference = greedy(
        tiny_runner(resolve_on(runner="v2", mode=CUDAGraphMode.NONE), model=other), BATCH, 4
    )
    assert after.tokens == reference.tokens
    assert max_logit_difference(after, reference) <= 5e-5
    assert max_logit_difference(before, reference) > 1e-2  # the weights did change
