"""Generate from a checkpoint, or from the built-in tiny model, with breakable graph capture.

Examples:
  dsv4 run --prompt "Hello" --max-new-tokens 16
  dsv4 run --checkpoint ./ckpt --prompt-ids 1,2,3 --prompt-ids 4,5 --runner v1
  dsv4 run --platform rocm --simulate --json     # ROCm's policy, run on the CPU tape
Prompts given with --prompt are tokenised byte-level (vocabularies of 256 tokens or more).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from runners.cli.errors import UsageError
from runners.cli.options import (
    add_model_options,
    add_policy_options,
    parse_prompts,
    parse_token_ids,
)
from runners.cli.progress import Progress
from runners.cli.values import at_least, non_negative_float, probability
from runners.engine import (
    InvalidRequestError,
    RequestFailedError,
    RequestTooLongError,
    SamplingParams,
)
from runners.spec import EngineSpec, build_engine
from runners.threads import apply_threads

__all__ = ["add_arguments", "execute", "exit_code", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_argument_group("prompts and sampling")
    prompts.add_argument(
        "--prompt-ids",
        action="append",
        type=parse_token_ids,
        metavar="ID,ID,...",
        help="a prompt as comma-separated token ids (repeatable)",
    )
    prompts.add_argument(
        "--prompt", action="append", metavar="TEXT", help="a prompt as text (repeatable)"
    )
    prompts.add_argument("--max-new-tokens", type=at_least(1), default=16, help="default: 16")
    prompts.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 (default) is greedy decoding",
    )
    prompts.add_argument(
        "--top-k", type=at_least(0), default=0, help="0 (default) keeps every token"
    )
    prompts.add_argument("--top-p", type=probability, default=1.0, help="1.0 (default) is off")
    prompts.add_argument("--seed", type=int, default=None, help="sampling seed")
    prompts.add_argument(
        "--ignore-eos", action="store_true", help="keep generating after the EOS token"
    )
    add_model_options(parser)
    add_policy_options(parser, platform_required=False)


def spec_from_args(args: argparse.Namespace) -> Any:
    """The ``EngineSpec`` the model and policy options describe."""
    fields: dict[str, Any] = {
        "checkpoint": Path(args.checkpoint) if args.checkpoint else None,
        "platform": args.platform,
        "simulate": args.simulate,
        "runner": args.runner,
        "cudagraph_mode": args.cudagraph_mode,
        "eager_region": args.eager_region,
        "unsafe_region": args.unsafe_region,
    }
    if args.capture_sizes is not None:
        fields["capture_sizes"] = tuple(args.capture_sizes)
        fields["max_num_tokens"] = max(64, *args.capture_sizes)
    return EngineSpec(**fields)


def execute(args: argparse.Namespace) -> dict[str, Any]:
    prompts, from_text = parse_prompts(args.prompt_ids, args.prompt)
    progress = Progress.for_terminal(json_output=args.json)
    progress.update("loading model")
    engine = build_engine(spec_from_args(args))
    threads = apply_threads(args.threads, engine.runner.model.config.hidden_size)
    vocab = engine.runner.vocab_size
    if from_text and vocab < 256:
        raise UsageError(
            f"--prompt needs a byte-level vocabulary (>= 256 tokens); this has {vocab}"
        )
    eos = None if args.ignore_eos else engine.runner.model.config.eos_token_id
    params = SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=eos,
    )
    for prompt in prompts:
        try:
            engine.llm.check(prompt, params)
        except InvalidRequestError as refused:
            raise UsageError(f"{_flags_of(refused)}: {refused}") from None
    progress.update("capturing graphs")
    start = time.perf_counter()
    engine.runner.capture(
        lambda mode, size, seconds: progress.update(
            f"captured {mode.name} graph for {size} tokens in {seconds:.2f}s"
        )
    )
    capture_s = time.perf_counter() - start
    progress.done(f"captured {len(engine.runner.captured)} graphs in {capture_s:.2f}s")
    start = time.perf_counter()
    try:
        outputs = engine.llm.generate(
            prompts,
            params,
            progress=lambda p: progress.update(
                f"generating: {p.finished}/{p.total} requests, {p.generated_tokens} tokens"
            ),
        )
    except RequestFailedError as failure:
        outputs = failure.outputs  # the others ran to completion: report them all
    generate_s = time.perf_counter() - start
    generated = sum(len(o.output_ids) for o in outputs)
    progress.done(f"generated {generated} tokens in {generate_s:.2f}s")
    payload = engine.resolution.to_dict()
    payload["outputs"] = [
        {
            "prompt_ids": list(o.prompt_ids),
            "output_ids": list(o.output_ids),
            "finish_reason": o.finish_reason.value,
            **({"error": o.error} if o.error is not None else {}),
        }
        for o in outputs
    ]
    payload["failed_requests"] = sum(o.error is not None for o in outputs)
    payload["graphs"] = {
        "captured_sizes": sorted({size for _, size in engine.runner.captured}),
        "captured": [[mode.name, size] for mode, size in engine.runner.captured],
        "num_graphs": engine.runner.num_graphs,
        "num_eager_breaks": engine.runner.num_eager_breaks,
    }
    payload["timing"] = {
        "capture_s": round(capture_s, 6),
        "generate_s": round(generate_s, 6),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / generate_s, 3) if generate_s > 0 else None,
    }
    payload["byte_level"] = from_text
    payload["threads"] = threads
    return payload


def _flags_of(refused: Exception) -> str:
    """The flags a refused request came from: its length is prompt plus new tokens."""
    prompt = "--prompt-ids/--prompt"
    return f"{prompt}/--max-new-tokens" if isinstance(refused, RequestTooLongError) else prompt


def exit_code(payload: dict[str, Any]) -> int:
    """1 when any request failed (its output says why; the others are reported as usual)."""
    return 1 if payload["failed_requests"] else 0


def _text(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def render(payload: dict[str, Any]) -> str:
    modes = payload["cudagraph_mode"]
    graphs = payload["graphs"]
    timing = payload["timing"]
    lines = [
        f"platform {payload['platform']}{' (simulated)' if payload['simulated'] else ''}, "
        f"runner {payload['runner']}, decode {modes['decode']}, mixed {modes['mixed']}, "
        f"eager region {payload['eager_region']}",
        f"graphs: {graphs['num_graphs']} graph segments, {graphs['num_eager_breaks']} eager "
        f"breaks, sizes {graphs['captured_sizes']}",
    ]
    for i, out in enumerate(payload["outputs"]):
        lines.append(f"[{i}] prompt {out['prompt_ids']}")
        lines.append(f"    output {out['output_ids']} ({out['finish_reason']})")
        if "error" in out:
            lines.append(f"    error  {out['error']}")
        if payload["byte_level"]:
            lines.append(f"    text   {_text(out['prompt_ids'])!r} -> {_text(out['output_ids'])!r}")
    lines.append(
        f"timing: capture {timing['capture_s']:.3f}s, generate {timing['generate_s']:.3f}s, "
        f"{timing['tokens_per_s']} tokens/s"
    )
    return "\n".join(lines)
