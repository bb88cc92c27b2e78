"""Load any OpenAI-compatible server with streamed completions and report its throughput and
latency (time to first token, inter-token latency, end to end: mean, p50, p90, p99).

Examples:
  dsv4 bench-serve --base-url http://127.0.0.1:8000 --model dsv4-tiny --concurrency 8
  dsv4 bench-serve --base-url http://127.0.0.1:8000 --model ./ckpt --request-rate 4 --json
  dsv4 bench-serve --base-url http://127.0.0.1:8000 --model ./ckpt --shared-prefix-len 2048

Tokens are counted from the usage the server reports. Prompts are --input-len random ASCII
characters (that many tokens on a byte-level vocabulary), after --shared-prefix-len characters
every prompt starts with (what a prefix cache serves); generation is greedy, --output-len
tokens at most (servers stop earlier at EOS unless --ignore-eos, which not every server takes).
The command fails (exit 1) if the server does not answer a first short request, or if any
request of the load fails.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from runners.cli.values import at_least, positive_float
from runners.measure.serving_load import LoadOptions, run_load

__all__ = ["add_arguments", "execute", "exit_code", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", required=True, help="the server's root, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument(
        "--num-prompts", type=at_least(1), default=32, help="requests to send (default: 32)"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=at_least(1),
        default=None,
        help="requests in flight at once (default: 8 unless --request-rate)",
    )
    load.add_argument(
        "--request-rate",
        type=positive_float,
        default=None,
        help="requests per second, Poisson arrivals (no bound on those in flight)",
    )
    parser.add_argument(
        "--input-len", type=at_least(1), default=32, help="prompt characters (default: 32)"
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=at_least(0),
        default=0,
        help="characters of one prefix every prompt starts with, before its own --input-len "
        "(default: 0)",
    )
    parser.add_argument(
        "--output-len", type=at_least(1), default=32, help="tokens per reply (default: 32)"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM's and dsv4's field)"
    )
    parser.add_argument(
        "--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY, if set)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")


def execute(args: argparse.Namespace) -> dict[str, Any]:
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 8
    options = LoadOptions(
        base_url=args.base_url,
        model=args.model,
        num_prompts=args.num_prompts,
        concurrency=concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        api_key=args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY"),
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
    )
    return run_load(options)


def exit_code(payload: dict[str, Any]) -> int:
    return 1 if payload["failed"] else 0


def _latency(name: str, values: dict[str, float | None]) -> str:
    if values["mean"] is None:
        return f"{name}: none"
    return (
        f"{name}: mean {values['mean']:.1f} ms, p50 {values['p50']:.1f}, "
        f"p90 {values['p90']:.1f}, p99 {values['p99']:.1f}"
    )


def render(payload: dict[str, Any]) -> str:
    load = (
        f"concurrency {payload['concurrency']}"
        if payload["request_rate"] is None
        else f"{payload['request_rate']} requests/s"
    )
    lines = [
        f"{payload['base_url']} ({payload['model']}): {payload['completed']} of "
        f"{payload['num_prompts']} requests in {payload['duration_s']:.2f}s, {load}",
        f"throughput: {payload['request_throughput']:.3f} requests/s, "
        f"{payload['output_throughput']:.2f} output tokens/s, "
        f"{payload['total_token_throughput']:.2f} tokens/s in all",
        f"tokens per request: {payload['mean_prompt_tokens']} prompt"
        + (
            f" (after a shared prefix of {payload['shared_prefix_len']} characters)"
            if payload["shared_prefix_len"]
            else ""
        )
        + f", {payload['mean_output_tokens']} output (from usage)",
        _latency("time to first token", payload["ttft_ms"]),
        _latency("inter-token latency", payload["itl_ms"]),
        _latency("end to end", payload["e2e_ms"]),
    ]
    if payload["failed"]:
        lines.append(f"failed: {payload['failed']} ({'; '.join(payload['errors'])})")
    return "\n".join(lines)
