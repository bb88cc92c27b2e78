"""The seed's bug, reproduced and caught on the CPU.

``ModelRunnerV1`` builds attention metadata as new tensors every step and captures with dummy
metadata. Forced (with the unsafe flag) to the narrow region, its captured input preparation
reads the capture-time dummy tensors forever: the capture audit names those reads, and with the
audit off the generated tokens differ from eager. ``ModelRunnerV2`` rewrites persistent buffers
in place, so the same narrow region is clean and exact.
"""

from __future__ import annotations

import functools

import pytest

from graphs import CaptureAuditError, NarrowRegion, WideRegion
from graphs.audit import AuditMode
from runners import CUDAGraphMode, ModelRunner, UnsafeRegionError
from tests.runners.support import MIXED_BATCH, greedy, resolve_on, tiny_runner

MAX_TOKENS = 6


@functools.cache
def eager_tokens() -> list[tuple[int, ...]]:
    runner = tiny_runner(resolve_on(runner="v2", mode=CUDAGraphMode.NONE))
    return greedy(runner, MIXED_BATCH, MAX_TOKENS).tokens


def v1_narrow(audit: AuditMode) -> ModelRunner:
    resolution = resolve_on(runner="v1", mode="PIECEWISE", region="narrow", unsafe=True)
    assert resolution.unsafe_region and resolution.eager_region == NarrowRegion()
    return tiny_runner(resolution, audit=audit, capture_sizes=(4,))


def test_v1_narrow_is_refused_without_the_unsafe_flag() -> None:
    with pytest.raises(UnsafeRegionError, match="required by runner v1"):
        resolve_on(runner="v1", mode="PIECEWISE", region="narrow")


def test_the_audit_raises_at_capture_naming_the_fresh_metadata_tensor() -> None:
    runner = v1_narrow("raise")
    with pytest.raises(CaptureAuditError, match=r"metadata\.py:\d+ in new_metadata") as info:
        runner.capture()
    assert "stale memory" in str(info.value)
    assert runner.captured == ()  # nothing half-captured is kept


def test_the_audit_reports_every_unstable_metadata_read_by_name() -> None:
    runner = v1_narrow("report")
    runner.capture()
    findings = runner.audit_findings
    assert findings
    text = "\n".join(f.message for f in findings)
    for name in ("slot_mapping", "token_request", "block_table"):
        assert name in text
    for finding in findings:
        assert "metadata.py" in finding.allocated_at
        assert finding.access == "reads"


def test_with_the_audit_off_the_tokens_differ_from_eager() -> None:
    runner = v1_narrow("off")
    assert greedy(runner, MIXED_BATCH, MAX_TOKENS).tokens != eager_tokens()


def test_v2_with_the_narrow_region_is_clean_and_exact() -> None:
    resolution = resolve_on(runner="v2", mode="PIECEWISE")
    assert resolution.eager_region == NarrowRegion() and not resolution.unsafe_region
    runner = tiny_runner(resolution, audit="report", capture_sizes=(4,))
    runner.capture()
    assert runner.audit_findings == ()
    assert greedy(runner, MIXED_BATCH, MAX_TOKENS).tokens == eager_tokens()
    assert runner.audit_findings == ()


def test_v1_with_its_wide_region_is_clean_and_exact() -> None:
    resolution = resolve_on(runner="v1", mode="PIECEWISE")
    assert resolution.eager_region == WideRegion()
    runner = tiny_runner(resolution, audit="report", capture_sizes=(4,))
    assert greedy(runner, MIXED_BATCH, MAX_TOKENS).tokens == eager_tokens()
    assert runner.captured and runner.audit_findings == ()
