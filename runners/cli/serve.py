"""Serve a checkpoint (or the built-in tiny model) over an OpenAI-compatible HTTP API.

Examples:
  dsv4 serve --checkpoint ./ckpt                       # http://127.0.0.1:8000/v1
  dsv4 serve --port 0                                  # a free port, printed when ready
  dsv4 serve --checkpoint ./ckpt --tensor-parallel-size 2 --api-key secret
  DSV4_API_KEY=secret dsv4 serve --checkpoint ./ckpt --served-model-name my-model

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, POST /detokenize, GET /metrics (Prometheus), GET /openapi.json (the schema).
The model is loaded and its graphs captured before the server accepts a connection; the line
"dsv4 serve: serving MODEL on http://HOST:PORT" on stderr says it is ready. SIGTERM or Ctrl-C
lets requests in flight finish (up to --shutdown-grace seconds) and exits 0; if the engine
fails (a rank dies), the server exits 1 with one line saying why. A request must arrive whole
within --request-timeout seconds (408 otherwise); what any request can cost is bounded before it
runs (docs/serving.md, "One client cannot stall the others").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from runners.cli.errors import UsageError
from runners.cli.options import add_model_options, add_policy_options
from runners.cli.run import spec_from_args
from runners.cli.values import at_least, byte_count, non_negative_float, positive_float
from runners.distributed import torchrun_world
from runners.engine import LLM
from runners.ranked import launch_engine
from runners.resolution import Resolution
from runners.spec import EngineSpec, build_engine
from runners.text import tokenizer_of
from runners.threads import apply_threads

__all__ = ["BUILTIN_MODEL_NAME", "add_arguments", "default_body_bytes", "execute", "render"]

BUILTIN_MODEL_NAME = "dsv4-tiny"
"""The served name of the built-in model (without --checkpoint or --served-model-name)."""
API_KEY_ENV = "DSV4_API_KEY"
REQUEST_TIMEOUT_S = 30.0
"""Seconds a request may take to arrive whole (head and body) before it gets 408."""
KEEP_ALIVE_S = 30.0
"""Seconds an idle connection is kept open: longer than clients keep theirs (httpx, and so the
``openai`` client, close an idle connection after 5 s), so the client closes it first and never
sends a request on a connection the server is closing."""
MIN_BODY_BYTES = 2**20
BODY_BYTES_PER_TOKEN = 16
"""A default body holds a ``max_model_len`` prompt as token ids (up to 8 bytes an id with its
separator, twice over) or as text of up to 16 bytes a token, and at least ``MIN_BODY_BYTES``."""


class EngineFailedError(RuntimeError):
    """The engine failed while serving (a rank died, the executor broke)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    group.add_argument("--port", type=_port, default=8000, help="port (8000; 0 picks a free one)")
    group.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"the model's name in the API (default: the --checkpoint argument as given, or "
        f"{BUILTIN_MODEL_NAME})",
    )
    group.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require Authorization: Bearer KEY on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV})",
    )
    group.add_argument(
        "--max-queued-requests",
        type=at_least(0),
        default=256,
        metavar="N",
        help="requests queued beyond --max-num-seqs before new ones get 503 (default: 256)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help=f"largest request body; larger ones get 413 (default: {BODY_BYTES_PER_TOKEN} "
        f"bytes per token of the context, at least 1MiB: 16MiB at a 1M-token context)",
    )
    group.add_argument(
        "--request-timeout",
        type=positive_float,
        default=REQUEST_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long a request may take to arrive whole, head and body, before it gets 408 "
        f"(default: {REQUEST_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=KEEP_ALIVE_S,
        metavar="SECONDS",
        help=f"how long an idle connection stays open (default: {KEEP_ALIVE_S:g}, longer than "
        "clients keep theirs)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may finish (default: 30)",
    )
    add_model_options(parser)
    add_policy_options(parser, platform_required=False)


def default_body_bytes(max_model_len: int) -> int:
    """The default ``--max-request-bytes`` for a context of ``max_model_len`` tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def _port(text: str) -> int:
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


@attrs.frozen(kw_only=True)
class _Served:
    """What the server needs of an engine, one rank or N (``launch_engine``)."""

    llm: LLM
    resolution: Resolution
    max_model_len: int
    capture: Callable[[], None]
    check: Callable[[], None]
    close: Callable[[], None]


def _start(spec: EngineSpec, threads: int | None) -> _Served:
    """Build the engine in this process, or launch its ranks (``--tensor-parallel-size``;
    they share the machine's threads)."""
    if spec.tensor_parallel_size == 1:
        engine = build_engine(spec)
        apply_threads(threads, engine.runner.model.config.hidden_size)
        capacity, llm = engine.capacity, engine.llm
        served = _Served(
            llm=llm,
            resolution=engine.resolution,
            max_model_len=llm.max_context,
            capture=engine.runner.capture,
            check=lambda: None,
            close=lambda: None,
        )
    else:
        ranked = launch_engine(spec)
        capacity, llm = ranked.capacity, ranked.llm
        served = _Served(
            llm=llm,
            resolution=ranked.resolution,
            max_model_len=llm.max_context,
            capture=ranked.ranks.capture,
            check=ranked.ranks.check,
            close=ranked.close,
        )
    if capacity is not None:
        served = attrs.evolve(served, max_model_len=min(capacity.max_model_len, llm.max_context))
    return served


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Serve until SIGTERM/SIGINT (the payload summarises the run) or the engine fails."""
    if torchrun_world() is not None:
        raise UsageError(
            "dsv4 serve starts its own ranks (--tensor-parallel-size N); do not run it under "
            "torchrun"
        )
    spec = attrs.evolve(spec_from_args(args), load_progress=False)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    name = args.served_model_name or args.checkpoint or BUILTIN_MODEL_NAME
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    # The server's libraries (FastAPI, uvicorn, pydantic: about 0.5 s) load for this command
    # alone, so every other command starts without them.
    from runners.serve import bind

    sock = bind(args.host, args.port)
    try:
        served = _start(spec, args.threads)
        try:
            return _serve(args, served, sock, checkpoint, name, api_key)
        finally:
            served.close()
    finally:
        sock.close()


def _serve(
    args: argparse.Namespace,
    served: _Served,
    sock: Any,
    checkpoint: Path | None,
    name: str,
    api_key: str | None,
) -> dict[str, Any]:
    from runners.serve import EngineLoop, Metrics, ServerContext, ServerSettings, build_app, serve

    start = time.perf_counter()
    served.capture()
    capture_s = time.perf_counter() - start
    llm = served.llm
    settings = ServerSettings(
        model_name=name,
        max_model_len=served.max_model_len,
        api_key=api_key,
        max_body_bytes=args.max_request_bytes or default_body_bytes(served.max_model_len),
        max_pending=args.max_num_seqs + args.max_queued_requests,
    )
    metrics = Metrics(name)
    loop = EngineLoop(llm, metrics, check=served.check)
    context = ServerContext(
        settings=settings,
        tokenizer=tokenizer_of(checkpoint, llm.vocab_size),
        vocab_size=llm.vocab_size,
        loop=loop,
        metrics=metrics,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def ready() -> None:
        print(f"dsv4 serve: serving {name!r} on {url}", file=sys.stderr, flush=True)

    try:
        failure = serve(
            build_app(context),
            sock,
            loop,
            grace_s=args.shutdown_grace,
            on_ready=ready,
            request_timeout_s=args.request_timeout,
            keep_alive_s=args.keep_alive_timeout,
        )
    finally:
        context.close()
    if failure is not None:
        raise EngineFailedError(failure)
    sample = metrics.registry.get_sample_value
    ended = {
        reason: int(sample("dsv4:request_success_total", {"finished_reason": reason}) or 0)
        for reason in ("stop", "length", "abort", "error")
    }
    return {
        **served.resolution.to_dict(),
        "model": name,
        "url": url,
        "max_model_len": served.max_model_len,
        "capture_s": round(capture_s, 6),
        "requests": ended,
        "generated_tokens": int(sample("dsv4:generation_tokens_total") or 0),
    }


def render(payload: dict[str, Any]) -> str:
    ended = payload["requests"]
    return (
        f"served {payload['model']!r} on {payload['url']}: "
        f"{sum(ended.values())} requests ({ended['stop']} stopped, {ended['length']} at their "
        f"length, {ended['abort']} aborted, {ended['error']} failed), "
        f"{payload['generated_tokens']} tokens generated"
    )
