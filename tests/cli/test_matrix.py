"""``dsv4 matrix``: V1 with a region narrower than wide is refused, or caught by the audit under
``--unsafe-region``; every other cell equals eager."""

from __future__ import annotations

import json

import pytest

from runners.cli.main import main

SMALL = ["--platform", "cpu", "--prompt-ids", "3,1,4,1,5,9", "--prompt-ids", "2,7"]
SMALL += ["--max-new-tokens", "3", "--capture-sizes", "1,2,4", "--threads", "1", "--json"]
NARROWER_THAN_WIDE = ("full-graph", "narrow")


def _cells(capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict]:
    assert main(["matrix", *SMALL, *extra]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["cells"]) == 2 * 4 * 5
    return payload["cells"]


def _v1_narrow_capturing(cell: dict) -> bool:
    return (
        cell["runner"] == "v1"
        and cell["eager_region"] in NARROWER_THAN_WIDE
        and cell["cudagraph_mode"] != "NONE"
    )


def test_matrix_refuses_v1_narrow_and_every_other_cell_equals_eager(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for cell in _cells(capsys):
        if _v1_narrow_capturing(cell):
            assert cell["status"] == "refused"
            assert "wide" in cell["detail"]
        elif cell["status"] != "refused":
            assert cell["status"] == "equal", cell
            assert cell["max_abs_diff"] <= 1e-5


def test_unsafe_v1_narrow_is_an_audit_error(capsys: pytest.CaptureFixture[str]) -> None:
    for cell in _cells(capsys, "--unsafe-region"):
        if _v1_narrow_capturing(cell):
            assert cell["status"] == "audit-error"
            assert "allocated" in cell["detail"]
        else:
            assert cell["status"] == "equal", cell
