"""Prometheus metrics of one server, under vLLM's names with the prefix ``dsv4:``.

Each server has its own ``CollectorRegistry`` (no process-global state, so several servers, or
tests, never share counts). The engine loop thread writes them (``prometheus_client`` is
thread-safe); ``GET /metrics`` renders them in the text exposition format.

- ``dsv4:num_requests_running`` / ``dsv4:num_requests_waiting``: requests the engine holds in a
  row / queued for one (including preempted ones), after the last step.
- ``dsv4:kv_cache_usage_perc``: the share of KV blocks in use, 0 to 1 (vLLM's convention).
- ``dsv4:prompt_tokens_total`` (counted once a request's prefill is done),
  ``dsv4:generation_tokens_total``, ``dsv4:num_preemptions_total``,
  ``dsv4:request_success_total{finished_reason}`` (``stop``, ``length``, ``abort``, ``error``).
- ``dsv4:prefix_cache_queries_total`` / ``dsv4:prefix_cache_hits_total``: tokens, as vLLM
  counts them: the tokens of every request looked up in the prefix cache when it was admitted
  (again when a preempted one resumes), and the tokens found there (not computed); their ratio
  is the hit rate. Both stay 0 with ``--no-enable-prefix-caching``.
- Histograms ``dsv4:time_to_first_token_seconds``, ``dsv4:inter_token_latency_seconds`` and
  ``dsv4:e2e_request_latency_seconds``, timed from when the server queued the request.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from runners.engine import EngineStats

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


class Metrics:
    """The server's metrics (module docstring); ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.running = Gauge(
            "dsv4:num_requests_running", "Requests in a row of the engine.", registry=r
        )
        self.waiting = Gauge("dsv4:num_requests_waiting", "Requests waiting for a row.", registry=r)
        self.kv_usage = Gauge(
            "dsv4:kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1).", registry=r
        )
        self.prompt_tokens = Counter("dsv4:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("dsv4:generation_tokens", "Tokens generated.", registry=r)
        self.preemptions = Counter(
            "dsv4:num_preemptions", "Requests preempted (recomputed later).", registry=r
        )
        self.prefix_queries = Counter(
            "dsv4:prefix_cache_queries",
            "Tokens of the requests looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "dsv4:prefix_cache_hits", "Tokens found in the prefix cache.", registry=r
        )
        self.success = Counter(
            "dsv4:request_success",
            "Requests ended, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "dsv4:time_to_first_token_seconds",
            "Seconds from queueing to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dsv4:inter_token_latency_seconds",
            "Seconds between a request's consecutive tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dsv4:e2e_request_latency_seconds",
            "Seconds from queueing to the end of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._info = Gauge("dsv4:model_info", "The served model.", list(labels), registry=r)
        self._info.labels(**labels).set(1)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(finished_reason=reason)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def next_tokens(self, seconds: float, tokens: int) -> None:
        """``tokens`` more tokens ``seconds`` after the previous ones (one step: one each)."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def finished(self, reason: str, seconds: float) -> None:
        self.success.labels(finished_reason=reason).inc()
        self.e2e.observe(seconds)

    def engine_state(self, stats: EngineStats) -> None:
        """The engine after a step: queues, cache use, preemptions and prefix-cache tokens so
        far."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(1.0 - stats.free_blocks / stats.total_blocks)
        if stats.preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.preemptions
        cache = stats.prefix_cache
        if cache is not None and (cache.query_tokens, cache.hit_tokens) != self._prefix_seen:
            queried, hit = self._prefix_seen
            self.prefix_queries.inc(cache.query_tokens - queried)
            self.prefix_hits.inc(cache.hit_tokens - hit)
            self._prefix_seen = (cache.query_tokens, cache.hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
