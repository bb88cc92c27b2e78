"""Show how a run would be resolved: runner, graph modes, eager region, and why.

No model is loaded, so this works for every registered platform on any machine, simulated or
not, and at any tensor parallel size (the collectives' policy is the platform's).
Example: dsv4 explain --platform rocm --architecture DeepseekV4ForCausalLM
         dsv4 explain --platform cpu --tensor-parallel-size 2   # collectives break: no FULL
"""

from __future__ import annotations

import argparse
from typing import Any

from dsv4.config import ARCHITECTURE
from runners import resolve
from runners.cli.options import SIMULATE_HELP, add_policy_options
from runners.cli.values import at_least
from runners.spec import resolve_platform

__all__ = ["add_arguments", "execute", "render"]

DEFAULT_ARCHITECTURE = ARCHITECTURE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_options(parser, platform_required=True)
    parser.add_argument(
        "--architecture",
        default=DEFAULT_ARCHITECTURE,
        help=f"model architecture as in config.json (default: {DEFAULT_ARCHITECTURE})",
    )
    parser.add_argument("--simulate", action="store_true", help=SIMULATE_HELP)
    parser.add_argument(
        "--tensor-parallel-size",
        type=at_least(1),
        default=1,
        metavar="N",
        help="ranks the model is split over (default: 1); above 1, collectives the platform "
        "cannot capture into a graph downgrade FULL graphs to PIECEWISE",
    )


def execute(args: argparse.Namespace) -> dict[str, Any]:
    resolution = resolve(
        args.architecture,
        resolve_platform(args.platform, simulated=args.simulate),
        runner=args.runner,
        cudagraph_mode=args.cudagraph_mode,
        eager_region=args.eager_region,
        unsafe_region=args.unsafe_region,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    payload = resolution.to_dict()
    payload["requirements"] = {
        "platform": resolution.platform.eager_region_strategy.name,
        "runner": resolution.runner.eager_region_strategy.name,
    }
    return payload


def render(payload: dict[str, Any]) -> str:
    """The resolution as aligned lines; the ``parallel`` line appears only above size 1, so a
    single-process explanation reads as it always has."""
    modes = payload["cudagraph_mode"]
    region = payload["eager_region"]
    required = payload["required_region"]
    region_note = f"required: {required}" + (
        ", UNSAFE by request" if payload["unsafe_region"] else ""
    )
    lines = [
        f"architecture   {payload['architecture']}",
        f"platform       {payload['platform']}" + (" (simulated)" if payload["simulated"] else ""),
    ]
    size = payload["tensor_parallel_size"]
    if size > 1:
        where = "captured in the graphs" if payload["collectives_in_graph"] else "as eager breaks"
        lines.append(
            f"parallel       tensor {size}, {payload['distributed_backend']} collectives {where}"
        )
    lines += [
        f"runner         {payload['runner']}",
        f"graph mode     decode {modes['decode']}, mixed {modes['mixed']}",
        f"eager region   {region} ({region_note})",
        f"requirements   platform {payload['requirements']['platform']}, "
        f"runner {payload['requirements']['runner']}",
        "reasons:",
    ]
    lines += [f"  {i}. {reason}" for i, reason in enumerate(payload["reasons"], 1)]
    return "\n".join(lines)
