"""``dsv4 bench --prefix-cache-ttft``: its options and its lines (``runners.measure.prefix_ttft``
measures)."""

from __future__ import annotations

import argparse
from typing import Any

from runners.cli.errors import UsageError
from runners.cli.values import at_least
from runners.measure.prefix_ttft import PrefixOptions

__all__ = ["add_prefix_arguments", "prefix_options", "render_prefix"]

_DEFAULTS = PrefixOptions()


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix cache (with --prefix-cache-ttft)")
    group.add_argument(
        "--prefix-cache-ttft",
        action="store_true",
        help="time to first token of requests that share a prefix, on an engine with the "
        "prefix cache and one without (--repeats requests each, interleaved)",
    )
    group.add_argument(
        "--shared-prefix-len",
        type=at_least(1),
        default=_DEFAULTS.prefix_len,
        metavar="N",
        help=f"tokens every request starts with (default: {_DEFAULTS.prefix_len})",
    )
    group.add_argument(
        "--suffix-len",
        type=at_least(1),
        default=_DEFAULTS.suffix_len,
        metavar="N",
        help=f"tokens of each request's own after it (default: {_DEFAULTS.suffix_len})",
    )


def prefix_options(args: argparse.Namespace) -> PrefixOptions:
    if args.threads is not None and len(args.threads) > 1:
        raise UsageError("--prefix-cache-ttft measures at one thread count: give one --threads")
    return PrefixOptions(
        prefix_len=args.shared_prefix_len,
        suffix_len=args.suffix_len,
        repeats=args.repeats or _DEFAULTS.repeats,
        threads=None if args.threads is None else args.threads[0],
    )


def render_prefix(payload: dict[str, Any]) -> str:
    ttft = payload["ttft_ms"]
    computed = payload["computed_tokens"]
    return "\n".join(
        [
            f"time to first token, {payload['prefix_len']} shared + {payload['suffix_len']} own "
            f"tokens, {payload['dtype']}, {payload['threads']} thread(s), chunks of "
            f"{payload['chunk']} tokens, median of {payload['repeats']}:",
            f"  with the prefix cache    {ttft['cached']:>10.1f} ms  "
            f"({payload['hit_tokens_per_request']} tokens found, {computed['cached']} computed)",
            f"  without                  {ttft['uncached']:>10.1f} ms  "
            f"({computed['uncached']} computed)",
            f"  ratio {payload['ratio']:.4f} (tokens computed: {payload['computed_ratio']:.4f})",
        ]
    )
