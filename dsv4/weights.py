"""Random weights with unit-scale activations, for tests and demo checkpoints.

The reference initialises sinks, position biases and hyper-connection bases to zero and uses a
small normal elsewhere; a model with such weights has near-uniform attention and near-zero
logits, so a comparison against it proves little. ``randomize_`` instead draws every tensor so
that activations stay O(1): matrices ~ N(0, 1/fan_in), norm weights and hyper-connection
scales near one, sinks, position biases and bases of order one, random hash tables and router
biases. The draw is a pure function of the seed and the parameter names and shapes, the same on
every CPU: normals are drawn in float64 (ATen draws those one at a time with the C library's
``log`` and ``cos``) and rounded to float32; ATen's float32 ``randn`` takes a vectorized path
whose bits depend on the instruction set.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["randomize_"]


def _normal(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Standard normal float32 values of ``shape``, the same on every CPU."""
    return torch.randn(shape, generator=generator, dtype=torch.float64).float()


def _draw(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    noise = _normal(shape, generator)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * noise
    if name.endswith(("sinks", "position_bias", "embed_tokens.weight")):
        return noise
    if name.endswith(("hc.base", "hc_base")):
        return 0.5 * noise
    if name.endswith(("hc.scale", "hc_scale")):
        return 1 + 0.2 * noise
    return noise / shape[-1] ** 0.5


@torch.no_grad()
def randomize_(model: nn.Module, seed: int, *, num_experts: int) -> None:
    """Overwrite every parameter and persistent buffer of ``model`` in place from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        parameter.copy_(_draw(name, parameter.shape, generator))
    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            buffer.copy_(torch.randint(0, num_experts, buffer.shape, generator=generator))
        elif name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * _normal(buffer.shape, generator))
