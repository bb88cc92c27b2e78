"""Shared test configuration: hypothesis profiles and the `cuda` marker.

Profiles (choose with ``HYPOTHESIS_PROFILE``):
- ``dev``: few examples, fast feedback while editing.
- ``ci``: derandomized, so a CI failure reproduces exactly; the default under ``make test``.
- ``thorough``: many examples for long runs before a release.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``@pytest.mark.cuda`` test, with a reason, where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
