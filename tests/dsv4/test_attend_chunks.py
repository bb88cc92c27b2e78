"""Attending queries in slices of ``ATTEND_CHUNK`` (to bound each step's per-token gathers)
changes no query's result: a 100-token step and mixed steps give the logits of attending every
query at once, bit for bit."""

from __future__ import annotations

import pytest
import torch

import dsv4.attention
from dsv4 import DeepseekV4Config
from dsv4.testing import random_model, run_schedule

PROMPTS = [[(5 * i + 3) % 256 for i in range(100)], [(11 * i + 1) % 256 for i in range(70)]]
STEPS = [
    [(0, 100), (1, 37)],  # 137 queries: four full slices of 32 and a partial one
    [(1, 33)],
]


def test_slices_of_queries_give_the_logits_of_all_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert dsv4.attention.ATTEND_CHUNK < 100
    model = random_model(DeepseekV4Config.tiny(), 5)
    sliced = run_schedule(model, PROMPTS, STEPS, block_size=8)
    monkeypatch.setattr(dsv4.attention, "ATTEND_CHUNK", 1000)
    whole = run_schedule(model, PROMPTS, STEPS, block_size=8)
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)
