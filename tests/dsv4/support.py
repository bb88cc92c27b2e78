"""Shared support for the model's tests: the Hugging Face oracle (``transformers`` 5.23.0).

Random configs, prompts and models come from ``dsv4.testing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

from dsv4.hf_config import config_to_hf_dict
from dsv4.model import DeepseekV4ForCausalLM


def hf_twin(model: DeepseekV4ForCausalLM) -> transformers.DeepseekV4ForCausalLM:
    """The Hugging Face model with the same config and weights (eager attention)."""
    hf_config = transformers.DeepseekV4Config(**config_to_hf_dict(model.config))
    hf = transformers.DeepseekV4ForCausalLM(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def hf_logits(hf: transformers.DeepseekV4ForCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    """Uncached Hugging Face logits ``[len(prompt), vocab]`` of one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([list(prompt)]), use_cache=False).logits[0].float()


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
