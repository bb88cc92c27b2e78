"""Peak resident memory of loading a checkpoint, against the loaded model's own bytes
(``dsv4 bench-load``).

Method (the README's loading-memory figures are taken this way; Linux, it reads ``/proc``):
- warm-up: the process first loads a tiny random checkpoint of the same layout (plain, or the
  published quantized layout with the same expert format and scale format) in the same dtype
  and mode, so imports, kernels and the allocator's first growth are not charged to the load;
  that model is dropped and garbage collected;
- the kernel's high-water mark of the resident set is reset (``5`` written to
  ``/proc/self/clear_refs``) and the resident set read (``VmRSS`` of ``/proc/self/status``);
- ``load_checkpoint`` runs; the **rise** is ``VmHWM`` after it minus ``VmRSS`` before it:
  everything the load made resident at its peak (the model, transient blocks, mapped file
  pages, allocator slack);
- **model bytes**: every parameter and persistent buffer of the loaded model, each storage once
  (what its ``state_dict`` holds); **ratio** = rise / model bytes.
Where the mark cannot be reset, the rise is taken against the mark the warm-up left, which is
valid only when the load sets a new one; otherwise the measurement is refused.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import attrs
import torch
from torch import nn

from dsv4 import DeepseekV4Config, load_checkpoint, save_random_checkpoint
from dsv4.dtypes import dtype_name
from dsv4.hf_config import CONFIG_FILE, load_config
from dsv4.load_progress import ProgressOption
from dsv4.quantization import QuantizationConfig
from dsv4.quantized_writer import save_random_quantized_checkpoint

__all__ = ["LoadMemory", "LoadMemoryError", "measure_load", "model_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_SLACK = 2**20
"""How far above the resident set the mark may read right after a reset that worked."""


class LoadMemoryError(RuntimeError):
    """The peak could not be measured on this system."""


@attrs.frozen(kw_only=True)
class LoadMemory:
    """One measured load (see the module docstring)."""

    checkpoint: str
    dtype: str
    quantization: str
    """``none`` for a plain checkpoint, else the mode it loaded in."""
    rise_bytes: int
    model_bytes: int
    retained_bytes: int
    """Resident set after the load minus before it (the model and what the allocator kept)."""
    baseline_bytes: int
    seconds: float
    peak_reset: bool
    """Whether the high-water mark was reset before the load (else the warm-up's was used)."""

    @property
    def ratio(self) -> float:
        return self.rise_bytes / self.model_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "checkpoint": self.checkpoint,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "peak_rss_rise_bytes": self.rise_bytes,
            "model_bytes": self.model_bytes,
            "ratio": self.ratio,
            "retained_rss_bytes": self.retained_bytes,
            "baseline_rss_bytes": self.baseline_bytes,
            "load_seconds": self.seconds,
            "peak_reset": self.peak_reset,
        }


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer of ``model``, each storage once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _resident() -> tuple[int, int]:
    """``(VmHWM, VmRSS)`` of this process, in bytes."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError as exc:
        raise LoadMemoryError(f"cannot read {_STATUS} (Linux only): {exc}") from None
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines[1:] if "kB" in line}
    return fields["VmHWM"], fields["VmRSS"]


def _reset_peak() -> bool:
    """Reset the high-water mark to the current resident set; whether that worked."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    peak, resident = _resident()
    return peak - resident <= _RESET_SLACK


def _warm_up(layout: QuantizationConfig | None, dtype: torch.dtype, quantization: str) -> None:
    """Load a tiny checkpoint of ``layout`` as the measured load will (see the module)."""
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-load-") as directory:
        tiny = DeepseekV4Config.tiny()
        if layout is None:
            save_random_checkpoint(directory, tiny, seed=0)
        else:
            save_random_quantized_checkpoint(
                directory, tiny, 0, expert_dtype=layout.expert_dtype, scale_fmt=layout.scale_fmt
            )
        load_checkpoint(directory, dtype=dtype, quantization=quantization, progress=None)
    gc.collect()


def measure_load(
    checkpoint: str | Path,
    *,
    dtype: torch.dtype,
    quantization: str = "auto",
    progress: ProgressOption = None,
) -> LoadMemory:
    """Load ``checkpoint`` as ``load_checkpoint(dtype=..., quantization=...)`` does and measure
    its peak resident memory (see the module docstring)."""
    directory = Path(checkpoint)
    load_config(directory)  # a broken checkpoint fails here, before the warm-up
    layout = QuantizationConfig.from_hf_config(json.loads((directory / CONFIG_FILE).read_text()))
    _warm_up(layout, dtype, quantization)
    peak_reset = _reset_peak()
    peak_before, before = _resident()
    start = time.perf_counter()
    model = load_checkpoint(directory, dtype=dtype, quantization=quantization, progress=progress)
    seconds = time.perf_counter() - start
    peak_after, after = _resident()
    if not peak_reset and peak_after <= peak_before:
        raise LoadMemoryError(
            "cannot measure the load's peak: the high-water mark cannot be reset here "
            "(/proc/self/clear_refs) and the warm-up's is above the load's"
        )
    mode = "none" if layout is None else ("weight-only" if quantization == "auto" else quantization)
    return LoadMemory(
        checkpoint=str(directory),
        dtype=dtype_name(dtype),
        quantization=mode,
        rise_bytes=peak_after - before,
        model_bytes=model_bytes(model),
        retained_bytes=after - before,
        baseline_bytes=before,
        seconds=seconds,
        peak_reset=peak_reset,
    )
