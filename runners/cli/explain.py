"""Show how a run would be resolved: runner, graph modes, eager region, and why.

No model is loaded, so this works for every registered platform on any machine.
Example: dsv4 explain --platform rocm --architecture DeepseekV4ForCausalLM
"""

from __future__ import annotations

import argparse
from typing import Any

from dsv4.config import ARCHITECTURE
from runners import resolve
from runners.cli.options import add_policy_options

__all__ = ["add_arguments", "execute", "render"]

DEFAULT_ARCHITECTURE = ARCHITECTURE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_options(parser, platform_required=True)
    parser.add_argument(
        "--architecture",
        default=DEFAULT_ARCHITECTURE,
        help=f"model architecture as in config.json (default: {DEFAULT_ARCHITECTURE})",
    )


def execute(args: argparse.Namespace) -> dict[str, Any]:
    resolution = resolve(
        args.architecture,
        args.platform,
        runner=args.runner,
        cudagraph_mode=args.cudagraph_mode,
        eager_region=args.eager_region,
        unsafe_region=args.unsafe_region,
    )
    payload = resolution.to_dict()
    payload["requirements"] = {
        "platform": resolution.platform.eager_region_strategy.name,
        "runner": resolution.runner.eager_region_strategy.name,
    }
    return payload


def render(payload: dict[str, Any]) -> str:
    modes = payload["cudagraph_mode"]
    region = payload["eager_region"]
    required = payload["required_region"]
    region_note = f"required: {required}" + (
        ", UNSAFE by request" if payload["unsafe_region"] else ""
    )
    lines = [
        f"architecture   {payload['architecture']}",
        f"platform       {payload['platform']}" + (" (simulated)" if payload["simulated"] else ""),
        f"runner         {payload['runner']}",
        f"graph mode     decode {modes['decode']}, mixed {modes['mixed']}",
        f"eager region   {region} ({region_note})",
        f"requirements   platform {payload['requirements']['platform']}, "
        f"runner {payload['requirements']['runner']}",
        "reasons:",
    ]
    lines += [f"  {i}. {reason}" for i, reason in enumerate(payload["reasons"], 1)]
    return "\n".join(lines)
