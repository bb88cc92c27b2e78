"""Generate from a checkpoint, or from the built-in tiny model, with breakable graph capture.

Examples:
  dsv4 run --prompt "Hello" --max-new-tokens 16
  dsv4 run --checkpoint ./ckpt --prompt-ids 1,2,3 --prompt-ids 4,5 --runner v1
  dsv4 run --platform rocm --simulate --json     # ROCm's policy, run on the CPU tape
  dsv4 run --checkpoint ./ckpt --chat --prompt "Hello"   # through the chat template

--prompt TEXT is encoded by the checkpoint's tokenizer.json (special tokens as its
tokenizer_config.json says) and each output is decoded to text; without one (the built-in model),
text is byte-level (vocabularies of 256 tokens or more). On a terminal the text is printed as it
is generated. Generation stops at any id of eos_token_id in config.json or generation_config.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from dsv4.dtypes import dtype_name
from dsv4.tokenizer import CheckpointTokenizer
from runners.batch import StepReach
from runners.cli.errors import UsageError
from runners.cli.options import (
    add_model_options,
    add_policy_options,
    capacity_fields,
    parse_token_ids,
)
from runners.cli.progress import Progress
from runners.cli.prompts import (
    byte_level_text,
    check_prompt_flags,
    encode_prompts,
    load_tokenizer,
)
from runners.cli.streaming import StreamPrinter, generate_streaming
from runners.cli.values import at_least, non_negative_float, probability
from runners.engine import (
    InvalidRequestError,
    PrefixCacheStats,
    RequestFailedError,
    RequestOutput,
    RequestTooLongError,
    SamplingParams,
)
from runners.spec import Engine, EngineSpec, build_engine

__all__ = ["add_arguments", "execute", "exit_code", "prefix_cache_report", "render"]


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
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt as text (repeatable): the checkpoint's tokenizer encodes it, else bytes",
    )
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="wrap each --prompt TEXT as a user message in the checkpoint's chat template",
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
        "--ignore-eos",
        action="store_true",
        help="keep generating after an EOS token (eos_token_id of config.json and "
        "generation_config.json)",
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
        "quantization": args.quantization,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    if args.capture_sizes is not None:
        fields["capture_sizes"] = tuple(args.capture_sizes)
    return EngineSpec(**fields, **capacity_fields(args), load_progress=not args.json)


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Run the prompts; bad flags and a broken tokenizer fail before the model is loaded."""
    check_prompt_flags(args.prompt_ids, args.prompt, chat=args.chat)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    tokenizer = load_tokenizer(checkpoint, chat=args.chat)
    prompts = encode_prompts(args.prompt_ids, args.prompt, tokenizer, chat=args.chat)
    byte_level = bool(args.prompt) and tokenizer is None
    progress = Progress.for_terminal(json_output=args.json)
    progress.update("loading model")
    engine = build_engine(spec_from_args(args))
    threads = torch.get_num_threads()  # what build_engine set: --threads, or the size's default
    vocab = engine.runner.vocab_size
    if byte_level and vocab < 256:
        raise UsageError(
            f"--prompt needs a byte-level vocabulary (>= 256 tokens); this has {vocab}"
        )
    params = _sampling_params(args)
    for prompt in prompts:
        try:
            engine.llm.check(prompt, params)
        except InvalidRequestError as refused:
            raise UsageError(f"{_flags_of(refused)}: {refused}") from None
    progress.update("capturing graphs")
    start = time.perf_counter()
    engine.runner.capture(
        lambda key, seconds: progress.update(
            f"captured {key.mode.name} graph for {key.num_tokens} tokens, context "
            f"{key.width * engine.runner.layout.block_size}, in {seconds:.2f}s"
        ),
        reach=StepReach.of_requests([len(p) for p in prompts], params.max_tokens),
    )
    capture_s = time.perf_counter() - start
    progress.done(f"captured {len(engine.runner.captured)} graphs in {capture_s:.2f}s")
    decode = _decoder(tokenizer, byte_level)
    stream = decode if decode is not None and not args.json and sys.stdout.isatty() else None
    start = time.perf_counter()
    try:
        if stream is not None:
            outputs = _generate_streaming(engine, prompts, params, stream)
        else:
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
            **({"text": tokenizer.decode(o.output_ids)} if tokenizer is not None else {}),
            "finish_reason": o.finish_reason.value,
            **({"error": o.error} if o.error is not None else {}),
        }
        for o in outputs
    ]
    payload["failed_requests"] = sum(o.error is not None for o in outputs)
    payload["graphs"] = {
        "captured_sizes": sorted({key.num_tokens for key in engine.runner.captured}),
        "captured_contexts": sorted(
            {key.width * engine.runner.layout.block_size for key in engine.runner.captured}
        ),
        "captured": [
            [key.mode.name, key.num_tokens, key.width * engine.runner.layout.block_size]
            for key in engine.runner.captured
        ],
        "num_graphs": engine.runner.num_graphs,
        "num_eager_breaks": engine.runner.num_eager_breaks,
    }
    payload["timing"] = {
        "capture_s": round(capture_s, 6),
        "generate_s": round(generate_s, 6),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / generate_s, 3) if generate_s > 0 else None,
    }
    if engine.capacity is not None:
        payload["capacity"] = engine.capacity.to_dict()
    stats = engine.llm.stats()
    payload["engine"] = {
        "preemptions": stats.preemptions,
        "released_blocks": stats.released_blocks,
        "prefix_cache": prefix_cache_report(stats.prefix_cache),
    }
    payload["byte_level"] = byte_level
    payload["threads"] = threads
    payload["dtype"] = dtype_name(engine.runner.model.compute_dtype)
    if stream is not None:
        payload["streamed"] = True  # human output only (never with --json): text already shown
    return payload


def prefix_cache_report(stats: PrefixCacheStats | None) -> dict[str, Any]:
    """The prefix cache's counts as ``run --json`` reports them (``enabled: false`` when off):
    ``queries`` and ``hits`` count requests looked up and those that found a cached prefix,
    ``query_tokens`` and ``hit_tokens`` their tokens and the tokens found (not computed)."""
    if stats is None:
        return {"enabled": False}
    return {"enabled": True, **attrs.asdict(stats)}


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' sampling; the engine stops at every EOS id of the checkpoint unless
    --ignore-eos (``build_engine``). Text is decoded here, so the engine's is not asked for."""
    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        detokenize=False,
    )


def _decoder(
    tokenizer: CheckpointTokenizer | None, byte_level: bool
) -> Callable[[Sequence[int]], str] | None:
    """How output ids become text: the tokenizer's, bytes for text prompts without one, or
    None (no text to show)."""
    if tokenizer is not None:
        return tokenizer.decode
    return byte_level_text if byte_level else None


def _generate_streaming(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    decode: Callable[[Sequence[int]], str],
) -> list[RequestOutput]:
    """Generate while printing each request's text on stdout as its tokens arrive."""
    printer = StreamPrinter(len(prompts), decode, sys.stdout)
    try:
        return generate_streaming(engine.llm, prompts, params, printer.update)
    finally:
        printer.close_line()


def _flags_of(refused: Exception) -> str:
    """The flags a refused request came from: its length is prompt plus new tokens."""
    prompt = "--prompt-ids/--prompt"
    return f"{prompt}/--max-new-tokens" if isinstance(refused, RequestTooLongError) else prompt


def exit_code(payload: dict[str, Any]) -> int:
    """1 when any request failed (its output says why; the others are reported as usual)."""
    return 1 if payload["failed_requests"] else 0


def render(payload: dict[str, Any]) -> str:
    modes = payload["cudagraph_mode"]
    graphs = payload["graphs"]
    timing = payload["timing"]
    lines = [
        f"platform {payload['platform']}{' (simulated)' if payload['simulated'] else ''}, "
        f"runner {payload['runner']}, decode {modes['decode']}, mixed {modes['mixed']}, "
        f"eager region {payload['eager_region']}",
        f"graphs: {graphs['num_graphs']} graph segments, {graphs['num_eager_breaks']} eager "
        f"breaks, sizes {graphs['captured_sizes']}, contexts {graphs['captured_contexts']}",
    ]
    capacity = payload.get("capacity")
    if capacity is not None:
        lines.append(
            f"capacity: max-model-len {capacity['max_model_len']}, {capacity['num_blocks']} "
            f"blocks of {capacity['block_size']} tokens "
            f"({capacity['kv_cache_bytes'] / 2**20:.1f} MiB of KV cache), "
            f"max-num-seqs {capacity['max_num_seqs']}"
        )
    cache = payload["engine"]["prefix_cache"]
    if cache["enabled"]:
        lines.append(
            f"prefix cache: {cache['hit_tokens']} of {cache['query_tokens']} prompt tokens found "
            f"cached ({cache['hits']} of {cache['queries']} requests)"
        )
    for i, out in enumerate(payload["outputs"]):
        lines.append(f"[{i}] prompt {out['prompt_ids']}")
        lines.append(f"    output {out['output_ids']} ({out['finish_reason']})")
        if "error" in out:
            lines.append(f"    error  {out['error']}")
        if payload.get("streamed"):
            continue  # its text was printed while it was generated
        if "text" in out:
            lines.append(f"    text   {out['text']!r}")
        elif payload["byte_level"]:
            prompt, output = byte_level_text(out["prompt_ids"]), byte_level_text(out["output_ids"])
            lines.append(f"    text   {prompt!r} -> {output!r}")
    lines.append(
        f"timing: capture {timing['capture_s']:.3f}s, generate {timing['generate_s']:.3f}s, "
        f"{timing['tokens_per_s']} tokens/s"
    )
    return "\n".join(lines)
