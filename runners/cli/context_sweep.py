"""``dsv4 bench --context-sweep``: its options and its table (``runners.measure.context_sweep``
measures)."""

from __future__ import annotations

import argparse
from typing import Any

from runners.cli.options import parse_positive_int_list
from runners.cli.values import at_least
from runners.measure.context_sweep import SweepOptions

__all__ = ["add_sweep_arguments", "render_sweep", "sweep_options"]

_DEFAULTS = SweepOptions()


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("context sweep (with --context-sweep)")
    group.add_argument(
        "--context-sweep",
        action="store_true",
        help="measure decode latency by actual context at a large --max-model-len (default "
        f"{_DEFAULTS.max_model_len}) against a {_DEFAULTS.baseline_max_model_len}-token one, "
        "per graph mode, prefill throughput of one long prompt, and KV bytes per token",
    )
    group.add_argument(
        "--contexts",
        type=parse_positive_int_list,
        default=list(_DEFAULTS.contexts),
        metavar="N,N,...",
        help="actual contexts of the decode steps (default: "
        f"{','.join(map(str, _DEFAULTS.contexts))})",
    )
    group.add_argument(
        "--prefill-tokens",
        type=at_least(1),
        default=_DEFAULTS.prefill_tokens,
        metavar="N",
        help=f"prompt length of the prefill run (default: {_DEFAULTS.prefill_tokens})",
    )
    group.add_argument(
        "--in-flight-output",
        type=at_least(1),
        default=_DEFAULTS.in_flight_output,
        metavar="N",
        help=f"tokens each of the {_DEFAULTS.in_flight_requests} requests in flight at a fixed "
        f"KV budget generates (default: {_DEFAULTS.in_flight_output})",
    )


def sweep_options(args: argparse.Namespace) -> SweepOptions:
    return SweepOptions(
        contexts=tuple(args.contexts),
        max_model_len=args.max_model_len or _DEFAULTS.max_model_len,
        repeats=args.repeats,
        prefill_tokens=args.prefill_tokens,
        prefill_chunk=args.max_num_batched_tokens or _DEFAULTS.prefill_chunk,
        block_size=args.block_size,
        threads=args.threads[0] if args.threads is not None else None,
        in_flight_output=args.in_flight_output,
    )


def render_sweep(payload: dict[str, Any]) -> str:
    decode = payload["decode"]
    contexts = list(next(iter(decode["median_us"].values())))
    shortest = decode["shortest_context"]
    header = f"{'mode':<11}" + "".join(f"{'ctx ' + c:>12}" for c in contexts)
    header += f"{'ctx ' + str(shortest) + ' @' + str(payload['baseline_max_model_len']):>16}"
    lines = [
        f"decode step, median µs, {payload['dtype']}, {payload['threads']} thread(s), "
        f"max-model-len {payload['max_model_len']}",
        header,
    ]
    for mode, row in decode["median_us"].items():
        baseline = decode["baseline_median_us"][mode]
        lines.append(
            f"{mode:<11}"
            + "".join(f"{row[c]:>12.1f}" for c in contexts)
            + f"{baseline:>16.1f}  (x{decode['ratio_to_baseline'][mode]:.2f})"
        )
    prefill = payload["prefill"]
    lines.append(
        f"prefill: {prefill['tokens']} tokens in chunks of {prefill['chunk']}: "
        f"{prefill['seconds']:.2f}s, {prefill['tokens_per_s']:.0f} tokens/s"
    )
    flight = payload["in_flight"]
    measured = flight["measured"]
    lines.append(
        f"in flight at a {flight['budget_bytes'] / 2**20:.0f} MiB KV budget, "
        f"{flight['requests']} requests of {flight['prompt']}+{flight['output']} tokens: "
        f"{measured['released']['mean_running']} running per step on average with block "
        f"release ({measured['released']['preemptions']} preemptions, "
        f"{measured['released']['steps']} steps), {measured['kept']['mean_running']} without "
        f"({measured['kept']['preemptions']} preemptions, {measured['kept']['steps']} steps), "
        f"{flight['previous_rules']} under the previous rules (one pool, worst case reserved)"
    )
    kv = payload["kv_bytes"]
    per_type = "; ".join(
        f"{name} x{kv['layers'][name]}: {sizes['per_token']} B/token"
        + (f", {sizes['per_entry_block']} B/entry block" if sizes["per_entry_block"] else "")
        for name, sizes in kv["per_layer_type"].items()
    )
    lines.append(f"KV bytes per layer: {per_type}")
    lines.append(
        f"(token state is kept for the last {kv['lookback']} positions, entries for the "
        f"request's life: an entry block covers {kv['block_size']} entries of one per "
        f"{kv['entry_rate']} tokens)"
    )
    return "\n".join(lines)
