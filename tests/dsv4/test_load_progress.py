"""Load progress (``dsv4.load_progress``): every stored tensor the load reads is reported once,
against totals taken from the files; on a terminal stderr a bar rewrites one line and ends it
(also when the load fails); on any other stderr nothing is written."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.errors import CheckpointError
from dsv4.load_progress import LoadProgress
from dsv4.quantized_writer import save_random_quantized_checkpoint


class _Stream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _stored(directory: Path) -> tuple[int, int]:
    """(tensors, bytes) the checkpoint's files hold, ``mtp.*`` left out."""
    count = nbytes = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                if not key.startswith("mtp."):
                    tensor = handle.get_tensor(key)
                    count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
    return count, nbytes


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("plain"), DeepseekV4Config.tiny(), 3)


@pytest.fixture(scope="module")
def fp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fp4")
    return save_random_quantized_checkpoint(directory, DeepseekV4Config.tiny(), 3, num_shards=2)


@pytest.mark.parametrize("layout", ["plain", "fp4"])
def test_every_stored_tensor_is_reported_once_against_the_files_totals(
    plain: Path, fp4: Path, layout: str
) -> None:
    directory = plain if layout == "plain" else fp4
    reports: list[LoadProgress] = []
    load_checkpoint(directory, progress=reports.append)
    tensors, nbytes = _stored(directory)
    assert [r.tensors for r in reports] == [*range(tensors + 1), tensors]
    assert all(r.total_tensors == tensors and r.total_bytes == nbytes for r in reports)
    assert [r.bytes for r in reports] == sorted(r.bytes for r in reports)
    assert reports[-1].bytes == nbytes
    assert [r.finished for r in reports] == [False] * (tensors + 1) + [True]


def _draws(text: str) -> list[str]:
    """The states of the line a bar rewrote in place (``\\r``-separated), trailing blanks off."""
    return [draw.rstrip() for draw in text.split("\r")[1:]]


def test_a_terminal_gets_one_line_rewritten_in_place_and_ended(
    plain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stderr = _Stream(tty=True)
    monkeypatch.setattr("sys.stderr", stderr)
    load_checkpoint(plain)
    tensors, nbytes = _stored(plain)
    text = stderr.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    draws = _draws(text)
    assert draws[0].startswith("loading checkpoint:   0%|")
    size = tqdm.format_sizeof(nbytes, divisor=1024)  # the files' bytes, as tqdm writes sizes
    assert draws[-1].startswith(f"loading checkpoint: 100%|##########| {size}/{size} [")
    assert draws[-1].endswith(f", {tensors}/{tensors} tensors]")


def test_a_failed_load_ends_the_line_before_the_error(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = shutil.copytree(plain, tmp_path / "bad")
    shard = bad / "model.safetensors"
    with safe_open(str(shard), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, str(shard))
    stderr = _Stream(tty=True)
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
    text = stderr.getvalue()
    assert text.endswith(" tensors]\n") and text.count("\n") == 1
    assert "100%" not in text  # the bar stopped where the load did


def test_nothing_is_written_when_stderr_is_not_a_terminal(
    plain: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    load_checkpoint(plain)
    assert capsys.readouterr().err == ""
    stderr = _Stream(tty=False)
    monkeypatch.setattr("sys.stderr", stderr)
    load_checkpoint(plain)
    assert stderr.getvalue() == ""
