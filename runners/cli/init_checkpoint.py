"""Write a random DeepSeek-V4 checkpoint in Hugging Face layout (config.json + safetensors).

Example: dsv4 init-checkpoint ./tiny-ckpt --preset tiny --seed 0

It also writes a small byte-level BPE tokenizer for the preset's vocabulary (tokenizer.json, and
tokenizer_config.json with BOS/EOS and a chat template), so --prompt TEXT, --chat and the decoded
text of 'dsv4 run' work on it; transformers' AutoTokenizer loads it too.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dsv4 import save_random_checkpoint
from dsv4.toy_tokenizer import save_toy_tokenizer
from runners.cli.errors import UsageError
from runners.cli.presets import PRESETS, preset_config

__all__ = ["add_arguments", "execute", "render"]


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
    save_random_checkpoint(directory, config, seed=args.seed)
    save_toy_tokenizer(directory, config)
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    return {
        "directory": str(directory),
        "preset": args.preset,
        "seed": args.seed,
        "files": files,
        "num_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
    }


def render(payload: dict[str, Any]) -> str:
    return (
        f"wrote a random '{payload['preset']}' checkpoint (seed {payload['seed']}) to "
        f"{payload['directory']}: {', '.join(payload['files'])}"
    )
