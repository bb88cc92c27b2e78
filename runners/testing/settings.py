"""The kit's own hypothesis settings, so that it behaves the same in any package.

A platform author's test suite has no ``conftest.py`` of ours: hypothesis' defaults there (a
200 ms deadline, health checks against slow data generation, minutes of shrinking) would fail or
stall a property whose every example builds a model and captures graphs. So the kit never relies
on a loaded profile: ``kit_settings()`` builds the settings its property runs under, from
``HYPOTHESIS_PROFILE`` read at test time:

- ``dev`` (also any name the kit does not know, and no name): a few examples, random.
- ``ci``: derandomized, so a CI failure reproduces exactly, and the blob to replay it printed.
- ``thorough``: many examples, and a failure is shrunk to a minimal model and batch.

Invariants:
- Every profile has no deadline and suppresses the slow-data health checks; only ``thorough``
  shrinks (a failure under ``dev`` or ``ci`` is reported as found, fully named by the kit, in
  seconds instead of after minutes of shrinking).
- Nothing is registered or loaded globally: the suite that imports the kit keeps its own
  profiles, and the kit's settings apply to the kit's property alone. Unset fields (verbosity,
  database) come from whatever profile that suite loaded.
- The counts keep the whole kit well under a minute on two CPU cores under ``dev`` and ``ci``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs
from hypothesis import HealthCheck, Phase, settings

__all__ = ["DEFAULT_PROFILE", "PROFILES", "PROFILE_ENV", "KitProfile", "kit_settings"]

PROFILE_ENV = "HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "dev"
_SLOW_OK = (HealthCheck.too_slow, HealthCheck.data_too_large)


@attrs.frozen(kw_only=True)
class KitProfile:
    """How hard the kit's random search tries (each example: one model, one configuration)."""

    max_examples: int = attrs.field(validator=attrs.validators.ge(1))
    derandomize: bool
    shrink: bool


PROFILES: Mapping[str, KitProfile] = {
    "dev": KitProfile(max_examples=5, derandomize=False, shrink=False),
    "ci": KitProfile(max_examples=8, derandomize=True, shrink=False),
    "thorough": KitProfile(max_examples=200, derandomize=False, shrink=True),
}


def kit_settings(environ: Mapping[str, str] | None = None) -> settings:
    """The settings of the kit's property for the profile ``HYPOTHESIS_PROFILE`` names now."""
    env = os.environ if environ is None else environ
    profile = PROFILES.get(env.get(PROFILE_ENV, "").strip(), PROFILES[DEFAULT_PROFILE])
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(
        max_examples=profile.max_examples,
        derandomize=profile.derandomize,
        phases=[*phases, Phase.shrink] if profile.shrink else phases,
        deadline=None,
        suppress_health_check=_SLOW_OK,
        report_multiple_bugs=False,
        print_blob=True,
    )
