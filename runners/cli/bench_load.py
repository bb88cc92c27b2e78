"""Measure the peak resident memory of loading a checkpoint against the model's own bytes.

The process first loads a tiny checkpoint of the same layout (warm-up), resets the kernel's
high-water mark of its resident set, loads --checkpoint, and reports the rise of the mark (peak
RSS rise), the bytes of the loaded model's parameters and persistent buffers, and their ratio.
Linux only (it reads /proc/self/status).

Examples:
  dsv4 init-checkpoint ./small --preset small
  dsv4 bench-load --checkpoint ./small                     # float32
  dsv4 bench-load --checkpoint ./small --dtype bfloat16 --json
  dsv4 bench-load --checkpoint ./small-fp8 --quantization dequantize
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dsv4.dtypes import resolve_dtype
from runners.cli.options import add_dtype_option, add_quantization_option
from runners.measure.load_memory import measure_load

__all__ = ["add_arguments", "execute", "render"]

_MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        required=True,
        help="Hugging Face-layout checkpoint (config.json + *.safetensors); required",
    )
    add_dtype_option(parser)
    add_quantization_option(parser)


def execute(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = Path(args.checkpoint)
    measured = measure_load(
        checkpoint,
        dtype=resolve_dtype(args.dtype, checkpoint),
        quantization=args.quantization,
        progress=None if args.json else "terminal",
    )
    return measured.to_json()


def render(payload: dict[str, Any]) -> str:
    return (
        f"loaded {payload['checkpoint']} ({payload['dtype']}, quantization "
        f"{payload['quantization']}) in {payload['load_seconds']:.2f}s\n"
        f"peak RSS rise:  {payload['peak_rss_rise_bytes'] / _MIB:.1f} MiB\n"
        f"model bytes:    {payload['model_bytes'] / _MIB:.1f} MiB (parameters and persistent "
        "buffers)\n"
        f"ratio:          {payload['ratio']:.3f}\n"
        f"still resident: {payload['retained_rss_bytes'] / _MIB:.1f} MiB after the load"
    )
