"""The kit's two equivalence passes: deterministic first, so a wrong claim fails in seconds.

- ``deterministic_pass``: every allowed configuration on one fixed tiny model and fixed prompts
  (``strategies.fixed_config``, ``FIXED_PROMPTS``, weights seed 0); all configurations run, and
  the failure lists every one that differs, so its pattern (only narrow regions, only FULL
  graphs) points at the wrong claim.
- ``random_search``: hypothesis draws a tiny model, a batch, weights and one allowed
  configuration per example, under ``kit_settings()``; the first failure is reported. The
  models tie on purpose (few indexer heads, zeroed indexer head weights: ``dsv4.testing``), so
  a configuration that breaks equal scores differently from eager (a different context width,
  chunking or batch) fails.

Invariants: both compare with an eager run of the same model and prompts on the same platform;
every failure is an ``AssertionError`` naming the platform, the configuration, the prompt and the
first differing token or the exception (chained, so its traceback is shown); torch runs on one
thread inside, and the count is restored afterwards (tiny models run fastest so, and the kit takes
the same time on any number of cores).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from dsv4 import DeepseekV4Config
from platforms.base import Platform
from runners.measure.benchmark import torch_threads
from runners.testing.checks import (
    Configuration,
    Workload,
    check_configuration,
    platform_label,
)
from runners.testing.settings import kit_settings
from runners.testing.strategies import (
    FIXED_PROMPTS,
    configs,
    fixed_config,
    indexer_weights,
    prompt_batches,
)

__all__ = ["deterministic_pass", "random_search"]


def deterministic_pass(
    platform: Platform,
    configurations: Sequence[Configuration],
    *,
    atol: float | None,
    max_new_tokens: int,
) -> None:
    """Every configuration on the fixed model and prompts; raise listing each that differs."""
    with torch_threads(1):
        workload = Workload.build(
            platform, fixed_config(), FIXED_PROMPTS, seed=0, max_new_tokens=max_new_tokens
        )
        found = [
            (configuration, difference)
            for configuration in configurations
            if (difference := check_configuration(configuration, workload, atol=atol))
        ]
    if found:
        raise AssertionError(
            f"{platform_label(platform)}: {len(found)} of {len(configurations)} allowed "
            "configurations differ from eager on the kit's fixed model (strategies.fixed_config, "
            f"weights seed 0) and prompts {[list(p) for p in FIXED_PROMPTS]}:\n"
            + "\n".join(f"  {c}: {d}" for c, d in found)
        ) from next((d.error for _, d in found if d.error is not None), None)


def random_search(
    platform: Platform,
    configurations: Sequence[Configuration],
    *,
    atol: float | None,
    max_new_tokens: int,
) -> None:
    """Random models, batches and weights, one configuration each; raise on the first that
    differs (hypothesis adds the falsifying example: the full config)."""

    @kit_settings()
    @given(
        config=configs(),
        prompts=prompt_batches(),
        seed=st.integers(0, 2**16),
        indexer=indexer_weights,
        configuration=st.sampled_from(list(configurations)),
    )
    def search(
        config: DeepseekV4Config,
        prompts: list[list[int]],
        seed: int,
        indexer: str,
        configuration: Configuration,
    ) -> None:
        with torch_threads(1):
            workload = Workload.build(
                platform,
                config,
                prompts,
                seed=seed,
                max_new_tokens=max_new_tokens,
                indexer=indexer,
            )
            difference = check_configuration(configuration, workload, atol=atol)
        if difference is not None:
            raise AssertionError(
                f"{platform_label(platform)}: {configuration}: random model (layers "
                f"{list(config.layer_types)}, {config.index_n_heads} indexer heads, weights "
                f"seed {seed}, indexer weights {indexer!r}), prompts {prompts}: {difference}"
            ) from difference.error

    search()
