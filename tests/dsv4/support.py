"""Shared support for the model's tests: the Hugging Face oracle (``transformers`` 5.23.0),
tie-aware (``tests.dsv4.hf_ties``: where equal scores straddle a top-k cut it takes the
model's rule, having checked that only tied entries differ).

Random configs, prompts and models come from ``dsv4.testing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

from dsv4.hf_config import config_to_hf_dict
from dsv4.model import DeepseekV4ForCausalLM
from tests.dsv4.hf_ties import tie_aware


def hf_twin(model: DeepseekV4ForCausalLM) -> transformers.DeepseekV4ForCausalLM:
    """The Hugging Face model with the same config and weights (eager attention), tie-aware."""
    hf_config = transformers.DeepseekV4Config(**config_to_hf_dict(model.config))
    hf = transformers.DeepseekV4ForCausalLM(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    tie_aware(hf)
    return hf


def hf_logits(hf: transformers.DeepseekV4ForCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    """Uncached Hugging Face logits ``[len(prompt), vocab]`` of one prompt (``hf`` made
    tie-aware first)."""
    tie_aware(hf)
    with torch.no_grad():
        return hf(torch.tensor([list(prompt)]), use_cache=False).logits[0].float()


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
