"""Write a random DeepSeek-V4 checkpoint in Hugging Face layout (config.json + safetensors).

Examples:
  dsv4 init-checkpoint ./tiny-ckpt --preset tiny --seed 0
  dsv4 init-checkpoint ./tiny-fp4 --quantization fp8-fp4   # the published quantized layout

--quantization writes the published quantized layout (official DeepSeek names, config.json's
quantization_config): FP8 e4m3 linears with 128x128 block scales (ue8m0), routed experts in FP8
blocks (fp8) or MXFP4 (fp8-fp4: int8-packed, a ue8m0 scale per 32 inputs; the expert sizes
must be multiples of 32), the compressors' and indexer's projections in bfloat16, the rest as
is. 'dsv4 run --checkpoint DIR --quantization weight-only|dequantize' loads it.

It also writes a small byte-level BPE tokenizer for the preset's vocabulary (tokenizer.json, and
tokenizer_config.json with BOS/EOS and a chat template), so --prompt TEXT, --chat and the decoded
text of 'dsv4 run' work on it; transformers' AutoTokenizer loads it too.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dsv4 import save_random_checkpoint
from dsv4.quantized_writer import save_random_quantized_checkpoint
from dsv4.toy_tokenizer import save_toy_tokenizer
from runners.cli.errors import UsageError
from runners.cli.presets import PRESETS, preset_config

__all__ = ["QUANTIZED_LAYOUTS", "add_arguments", "execute", "render"]

QUANTIZED_LAYOUTS = {"fp8": "fp8", "fp8-fp4": "fp4"}
"""``--quantization`` value -> the routed experts' ``expert_dtype``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the checkpoint")
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=tuple(PRESETS),
        help=f"model size preset: {', '.join(PRESETS)} (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("none", *QUANTIZED_LAYOUTS),
        help="none (default: float32 weights, Hugging Face names), or the published quantized "
        "layout with FP8 linears and FP8 (fp8) or MXFP4 (fp8-fp4) routed experts",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite a directory that already has a checkpoint"
    )


def execute(args: argparse.Namespace) -> dict[str, Any]:
    config = preset_config(args.preset)
    directory = Path(args.directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} exists and is not a directory")
    if (directory / "config.json").exists() and not args.force:
        raise UsageError(f"{directory} already holds a checkpoint; pass --force to overwrite it")
    directory.mkdir(parents=True, exist_ok=True)
    if args.quantization == "none":
        save_random_checkpoint(directory, config, seed=args.seed)
    else:
        expert_dtype = QUANTIZED_LAYOUTS[args.quantization]
        save_random_quantized_checkpoint(directory, config, args.seed, expert_dtype=expert_dtype)
    save_toy_tokenizer(directory, config)
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    return {
        "directory": str(directory),
        "preset": args.preset,
        "seed": args.seed,
        "quantization": args.quantization,
        "files": files,
        "num_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
    }


def render(payload: dict[str, Any]) -> str:
    layout = "" if payload["quantization"] == "none" else f" {payload['quantization']}"
    return (
        f"wrote a random '{payload['preset']}'{layout} checkpoint (seed {payload['seed']}) to "
        f"{payload['directory']}: {', '.join(payload['files'])}"
    )
