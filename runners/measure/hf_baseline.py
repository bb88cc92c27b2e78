"""The peer we measure generation against: Hugging Face ``transformers``' ``generate``.

``transformers`` is a test dependency, never a runtime one: it is imported only when this
baseline is asked for, and its absence is a one-line error saying how to install it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from dsv4 import DeepseekV4Config, save_random_checkpoint
from runners.measure.benchmark import GenerationThroughput, timed

__all__ = ["Baseline", "BaselineUnavailableError", "transformers_baseline"]


class BaselineUnavailableError(RuntimeError):
    """``transformers`` is not installed, so the peer comparison cannot run."""


def _load(checkpoint: Path | None, builtin_seed: int, dtype: torch.dtype) -> Any:
    """transformers' model in ``dtype`` (which keeps its own fp32 modules, as ours does)."""
    try:
        import transformers
    except ImportError:
        raise BaselineUnavailableError(
            "the transformers comparison needs transformers==5.23.0: pip install '.[test]'"
        ) from None
    if dtype == torch.float16:
        raise BaselineUnavailableError(
            "transformers 5.23.0 cannot run DeepSeek-V4 in float16 (it keeps the compressor "
            "projections in float32 and multiplies them with float16 activations); compare "
            "in float32 or bfloat16"
        )
    transformers.utils.logging.disable_progress_bar()
    if checkpoint is not None:
        return transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(tmp, DeepseekV4Config.tiny(), seed=builtin_seed)
        return transformers.DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=dtype).eval()


@attrs.frozen(kw_only=True)
class Baseline:
    """The peer's timed round, its ``generate`` tokens, and its uncached greedy tokens."""

    round: Callable[[], GenerationThroughput]
    generate_tokens: list[list[int]]
    uncached_tokens: list[list[int]]
    """Greedy tokens from full forwards without a cache: the oracle our engine must equal."""
    device: torch.device
    """Where the peer's model ran."""


def _uncached_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            inputs = torch.tensor([ids], device=model.device)
            ids.append(int(model(inputs).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def transformers_baseline(
    checkpoint: Path | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    builtin_seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Baseline:
    """A timed greedy ``generate`` round over ``prompts`` (one call each), with its tokens,
    computing in ``dtype`` on ``device`` (the engine's, so both compute alike, on one device:
    transformers' own default, the CPU, would set a CPU against a GPU)."""
    model = _load(checkpoint, builtin_seed, dtype).to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def generate_all() -> list[list[int]]:
        outputs = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([list(prompt)], dtype=torch.int64, device=model.device)
                out = model.generate(
                    ids,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=max_new_tokens,
                    do_sample=False,
                )
                outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    def round_() -> GenerationThroughput:
        result, seconds = timed(generate_all, model.device)
        return GenerationThroughput(tokens=sum(len(t) for t in result), seconds=seconds)

    return Baseline(
        round=round_,
        generate_tokens=generate_all(),
        uncached_tokens=[_uncached_greedy(model, p, max_new_tokens) for p in prompts],
        device=model.device,
    )
