"""The conformance kit for platform authors: one base class, capability flags, strategies.

Subclass ``PlatformConformanceTests`` in a test module, implement ``make_platform`` and set the
flags your policy promises; the inherited tests check the policy and prove every configuration
the resolution allows equal to eager — a deterministic pass, then a random search — on your
platform's device where available, simulated on the CPU otherwise (``SIMULATION_SCOPE`` says
what a simulated run can and cannot refute). The kit carries its own hypothesis settings
(``kit_settings``; ``HYPOTHESIS_PROFILE`` = ``dev``, ``ci`` or ``thorough``), so it needs no
``conftest.py``. Test-time only: needs pytest and hypothesis.
"""

from runners.testing.checks import SIMULATION_SCOPE, SimulatedRunWarning
from runners.testing.conformance import PlatformConformanceTests
from runners.testing.settings import kit_settings
from runners.testing.strategies import configs, prompt_batches

__all__ = [
    "SIMULATION_SCOPE",
    "PlatformConformanceTests",
    "SimulatedRunWarning",
    "configs",
    "kit_settings",
    "prompt_batches",
]
