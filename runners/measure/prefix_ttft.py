"""Time to first token with and without the prefix cache (``dsv4 bench --prefix-cache``).

Method: two engines over the same weights, one caching prefixes and one not, each with its own
caches and graphs (captured before timing). A first request of the shared prefix plus a suffix
warms both (and leaves the prefix in the caching engine's cache). Then each round sends one new
request to each engine — the same prefix, a suffix of its own (so only the prefix can be
found), one output token — and times it from ``add_request`` to its token (the whole prefill,
in chunks of the engine's token budget, and the sampling), the engine alone: no HTTP, no
tokenizer. Engines alternate, the first rotating; medians per engine, and their ratio. The
caching engine computes ``suffix_len`` tokens of each request (the prefix up to its last
boundary is found), the other ``prefix_len + suffix_len``: their ratio is what the cache could
save if a step's cost followed its tokens alone (attention over the whole context does not).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import attrs

from dsv4.dtypes import dtype_name
from runners.engine import LLM, SamplingParams
from runners.measure.benchmark import timed
from runners.spec import EngineSpec, build_engine, build_model
from runners.threads import apply_threads

__all__ = ["PrefixOptions", "run_prefix_ttft"]


@attrs.frozen(kw_only=True)
class PrefixOptions:
    prefix_len: int = 2048
    """Tokens every request starts with."""
    suffix_len: int = 32
    """Tokens of each request's own after the prefix."""
    repeats: int = 10
    """Timed requests per engine."""
    threads: int | None = None
    """Torch CPU threads (``None``: the default for the model's size, ``runners.threads``)."""


def run_prefix_ttft(
    base: EngineSpec, options: PrefixOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Measure (module docstring) on the engine ``base`` describes, its prefix caching aside."""
    progress("loading model")
    model = build_model(base)
    threads = apply_threads(options.threads, model.config.hidden_size)
    length = options.prefix_len + options.suffix_len
    context = max(base.max_model_len or 0, length + 1)  # the requests' length, at least
    spec = attrs.evolve(base, max_model_len=context, max_num_seqs=2)
    engines = {
        name: build_engine(attrs.evolve(spec, enable_prefix_caching=name == "cached"), model=model)
        for name in ("cached", "uncached")
    }
    vocab = min(256, model.config.vocab_size)
    prefix = [(7 * i + 3) % vocab for i in range(options.prefix_len)]

    def prompt(index: int) -> list[int]:
        return prefix + [(11 * index + 5 * i + 1) % vocab for i in range(options.suffix_len)]

    for name, engine in engines.items():
        progress(f"capturing graphs and warming up the {name} engine")
        engine.runner.capture()
        _first_token(engine.llm, prompt(0))
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(options.repeats):
        progress(f"round {round_index + 1}/{options.repeats}")
        names = list(engines)[round_index % 2 :] + list(engines)[: round_index % 2]
        for name in names:
            engine = engines[name]
            request = functools.partial(_first_token, engine.llm, prompt(1 + round_index))
            seconds[name].append(timed(request, engine.runner.device)[1])
    stats = engines["cached"].llm.stats().prefix_cache
    assert stats is not None
    median_ms = {name: round(statistics.median(s) * 1e3, 3) for name, s in seconds.items()}
    hit = stats.hit_tokens // stats.hits if stats.hits else 0
    return {
        "dtype": dtype_name(model.compute_dtype),
        "threads": threads,
        "prefix_len": options.prefix_len,
        "suffix_len": options.suffix_len,
        "chunk": spec.max_num_tokens,
        "repeats": options.repeats,
        "hits": stats.hits,
        "hit_tokens_per_request": hit,
        "computed_tokens": {"cached": length - hit, "uncached": length},
        "ttft_ms": median_ms,
        "ratio": round(median_ms["cached"] / median_ms["uncached"], 4),
        "computed_ratio": round((length - hit) / length, 4),
    }


def _first_token(llm: LLM, prompt: list[int]) -> None:
    """Run one request to its first (and only) token."""
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
