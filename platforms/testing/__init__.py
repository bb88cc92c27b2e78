"""The conformance kit for platform authors: one base class, capability flags, strategies.

Subclass ``PlatformConformanceTests`` in a test module, implement ``make_platform`` and set the
flags your policy promises; the inherited tests check the policy and run the cross-strategy
property suite on your platform (its device where available, simulated on the CPU otherwise).
Test-time only: needs pytest and hypothesis.
"""

from platforms.testing.conformance import PlatformConformanceTests
from platforms.testing.strategies import prompt_batches, tiny_configs

__all__ = ["PlatformConformanceTests", "prompt_batches", "tiny_configs"]
