"""One deterministic top-k: the model's only way to choose among scored candidates.

The rule: the ``k`` largest scores along the last dimension, in descending order of score;
**among equal scores the lower index wins** (and comes first). ``-0.0`` equals ``0.0``. So the
choice is a function of the scores and their order alone: appending candidates that score
lower (``-inf`` padding up to a context bucket, entries a query may not see yet) changes
neither which real candidates are chosen nor their order, and nothing else (the row's width,
the rows beside it, the device's top-k algorithm) can break a tie.

``torch.topk`` promises nothing among ties, and what it does changes with the row's width (on
a CPU a 600-wide row of zeros with a 1.0 at index 5 and ``k=4`` gives ``[5, 1, 3, 0]``) and
between devices. The indexer's scores are sums of ReLUs, so exact ties at the cut are common;
without a rule of its own the selection, hence the tokens, would depend on the graph bucket,
the prefill chunking and the batch.

How: each score is mapped to an int64 key that is unique per candidate and orders as
``(score, -index)`` does: the high 32 bits are an order-preserving integer image of the fp32
score (non-negative floats order as their bit patterns; a negative one as minus its magnitude's
bits, so ``-0.0`` and ``0.0`` meet at 0), the low 32 bits the reversed index. ``topk`` over
unique keys has a single answer, so any top-k algorithm returns it; shapes are static and
nothing is read on the host, so it captures into CUDA graphs and the CPU tape. Measured, it
costs about 1.5-3x a plain ``topk`` of the same row (a few elementwise passes), far below a
stable sort on long rows (``dsv4 bench`` in the README).
"""

from __future__ import annotations

import torch

__all__ = ["MAX_CANDIDATES", "stable_topk"]

MAX_CANDIDATES = 2**32
"""Most candidates one row may hold (the reversed index fills the key's low 32 bits)."""

_EXACT = (torch.float32, torch.bfloat16, torch.float16)
"""Score dtypes whose values float32 holds exactly (the key is built from float32 bits)."""
_LOW = 2**32


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the ``k`` largest ``scores`` along the last dimension, largest
    first, equal scores in ascending index order (see the module docstring).

    ``scores`` are float32 (or bfloat16/float16, widened exactly); ``k`` is at most the row's
    width. A NaN with the sign bit clear ranks above ``+inf``, one with it set below ``-inf``.
    """
    if scores.dtype not in _EXACT:
        raise TypeError(
            f"stable_topk takes float32, bfloat16 or float16 scores, not {scores.dtype}"
        )
    width = scores.shape[-1]
    if width > MAX_CANDIDATES:
        raise ValueError(f"{width} candidates in a row; at most {MAX_CANDIDATES} are supported")
    bits = scores.to(torch.float32).view(torch.int32)
    sign = bits >> 31  # -1 where the sign bit is set, else 0
    # a negative float's bits are (2**31 | magnitude): flip the magnitude, add one: -magnitude
    ordered = (bits ^ (sign & 0x7FFFFFFF)) - sign
    reversed_index = torch.arange(width - 1, -1, -1, device=scores.device)
    keys = torch.add(reversed_index, ordered, alpha=_LOW)
    return keys.topk(k, dim=-1).indices
