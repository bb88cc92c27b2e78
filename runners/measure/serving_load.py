"""A load generator for any OpenAI-compatible server: streamed completions at a fixed concurrency
or a Poisson request rate, with throughput and latency percentiles (``dsv4 bench-serve``).

Invariants:
- One request = ``POST {base}/v1/completions`` with ``stream: true`` and
  ``stream_options.include_usage``; tokens are counted from the ``usage`` the server reports
  (the chunk that carries it), never from the text, so servers that put several tokens in one
  chunk are counted right. A request whose stream reports no usage, breaks off, sends an error
  event or a non-200 status fails, with its reason; a stream may end with ``data: [DONE]`` or
  by closing (``transformers serve`` does the latter).
- As vLLM's benchmark measures them: time to first token is from sending the request to the
  first chunk with a choice; inter-token latency is the gap between consecutive such chunks;
  both, and the end-to-end latency, are reported as mean, p50, p90 and p99 over the requests
  that succeeded.
- Prompts are ``input_len`` random lowercase words and spaces, ``input_len`` characters long
  (``input_len`` tokens on a byte-level vocabulary; the report gives the server's count), a
  pure function of the seed, distinct per request, after one prefix of ``shared_prefix_len``
  such characters that every prompt starts with (a system prompt or a shared document: what a
  prefix cache serves; vLLM's benchmark calls it ``--random-prefix-len``). Greedy
  (``temperature`` 0).
- Only the standard library is used (``http.client`` in threads, one per request in flight),
  so it measures servers without bringing its own event loop into the comparison.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import statistics
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["LoadOptions", "RequestResult", "ServerUnreachableError", "make_prompts", "run_load"]

WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at")


class ServerUnreachableError(RuntimeError):
    """The server did not answer the first request (one line saying why)."""


@attrs.frozen(kw_only=True)
class LoadOptions:
    base_url: str
    model: str
    num_prompts: int
    output_len: int
    input_len: int
    concurrency: int | None = None
    request_rate: float | None = None
    """Requests per second (Poisson arrivals); None: all at once, up to ``concurrency``."""
    api_key: str | None = None
    ignore_eos: bool = False
    seed: int = 0
    shared_prefix_len: int = 0
    """Characters every prompt starts with, before its own ``input_len``."""
    timeout_s: float = 600.0


@attrs.frozen(kw_only=True)
class RequestResult:
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    latency_s: float = 0.0


def make_prompts(count: int, length: int, seed: int, shared_prefix_len: int = 0) -> list[str]:
    """``count`` prompts of ``shared_prefix_len + length`` characters, the first
    ``shared_prefix_len`` the same in all (module docstring)."""
    rng = random.Random(seed)
    prefix = ""
    if shared_prefix_len:
        prefix = _words(random.Random(f"{seed} prefix"), shared_prefix_len + 8)
        prefix = prefix[: shared_prefix_len - 1] + " "
    return [prefix + _words(rng, length) for _ in range(count)]


def _words(rng: random.Random, length: int) -> str:
    """``length`` characters of words drawn from ``WORDS``, separated by spaces."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < length:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:length]


class _Endpoint:
    def __init__(self, options: LoadOptions) -> None:
        url = urllib.parse.urlsplit(options.base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--base-url must be http(s)://HOST[:PORT], got {options.base_url!r}")
        self.url = url
        self.path = url.path.removesuffix("/v1") + "/v1/completions"
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if options.api_key:
            self.headers["Authorization"] = f"Bearer {options.api_key}"
        self.options = options

    def connect(self) -> http.client.HTTPConnection:
        kind = (
            http.client.HTTPSConnection
            if self.url.scheme == "https"
            else http.client.HTTPConnection
        )
        return kind(self.url.hostname or "", self.url.port, timeout=self.options.timeout_s)

    def body(self, prompt: str, max_tokens: int) -> bytes:
        fields: dict[str, Any] = {
            "model": self.options.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.options.ignore_eos:
            fields["ignore_eos"] = True
        return json.dumps(fields).encode()


def _one(endpoint: _Endpoint, prompt: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    chunks: list[float] = []
    usage: dict[str, Any] | None = None
    connection = endpoint.connect()
    try:
        connection.request(
            "POST", endpoint.path, endpoint.body(prompt, max_tokens), endpoint.headers
        )
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read(300).decode("utf-8", "replace")
            return RequestResult(
                ok=False, error=f"HTTP {response.status}: {' '.join(detail.split())}"
            )
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return RequestResult(ok=False, error=f"error event: {event['error']}"[:300])
            if event.get("choices"):
                chunks.append(time.perf_counter())
            usage = event.get("usage") or usage
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        connection.close()
    latency = time.perf_counter() - start
    if usage is None:
        return RequestResult(ok=False, error="the stream ended without usage")
    return RequestResult(
        ok=True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=chunks[0] - start if chunks else None,
        itl_s=tuple(b - a for a, b in itertools.pairwise(chunks)),
        latency_s=latency,
    )


def run_load(options: LoadOptions) -> dict[str, Any]:
    """Check the server with one short request, then run the load; the report (module
    docstring) as a JSON-ready dict."""
    endpoint = _Endpoint(options)
    probe = _one(endpoint, "Hello", 2)
    if not probe.ok:
        raise ServerUnreachableError(
            f"{options.base_url} did not serve a completion: {probe.error}"
        )
    prompts = make_prompts(
        options.num_prompts, options.input_len, options.seed, options.shared_prefix_len
    )
    results: list[RequestResult | None] = [None] * len(prompts)
    slots = threading.Semaphore(options.concurrency or len(prompts))
    gaps = random.Random(options.seed + 1)

    def send(index: int) -> None:
        try:
            results[index] = _one(endpoint, prompts[index], options.output_len)
        finally:
            slots.release()

    threads = []
    start = time.perf_counter()
    for index in range(len(prompts)):
        if options.request_rate is not None and index > 0:
            time.sleep(gaps.expovariate(options.request_rate))
        slots.acquire()
        thread = threading.Thread(target=send, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    duration = time.perf_counter() - start
    return _report(options, [r for r in results if r is not None], duration)


def _summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def percentile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    return {
        "mean": round(statistics.fmean(ordered) * 1000, 3),
        "p50": round(percentile(50) * 1000, 3),
        "p90": round(percentile(90) * 1000, 3),
        "p99": round(percentile(99) * 1000, 3),
    }


def _report(options: LoadOptions, results: list[RequestResult], duration: float) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    output = sum(r.completion_tokens for r in good)
    prompt = sum(r.prompt_tokens for r in good)
    return {
        "base_url": options.base_url,
        "model": options.model,
        "num_prompts": options.num_prompts,
        "concurrency": options.concurrency,
        "request_rate": options.request_rate,
        "input_len": options.input_len,
        "shared_prefix_len": options.shared_prefix_len,
        "output_len": options.output_len,
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(good) / duration, 4),
        "output_throughput": round(output / duration, 3),
        "total_token_throughput": round((output + prompt) / duration, 3),
        "mean_prompt_tokens": round(prompt / len(good), 2) if good else None,
        "mean_output_tokens": round(output / len(good), 2) if good else None,
        "ttft_ms": _summary([r.ttft_s for r in good if r.ttft_s is not None]),
        "itl_ms": _summary([gap for r in good for gap in r.itl_s]),
        "e2e_ms": _summary([r.latency_s for r in good]),
    }
