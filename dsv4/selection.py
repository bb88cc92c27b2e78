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

On the CPU, for float32 rows and ``k`` up to ``NATIVE_K``, one native op keeps each row's best
``k`` in a single pass (``dsv4::stable_topk_into``, the rule itself, so the same indices).
Elsewhere, two ways to the same answer, chosen by the scores' size (a static shape, so the
choice is fixed per captured graph): up to ``SORT_ELEMENTS`` scores, a stable descending sort,
sliced (one op; equal values keep their index order, and ``-0.0`` equals ``0.0``); above,
``topk`` over an int64 key that is unique per candidate and orders as ``(score, -index)``
does: the high 32 bits an order-preserving integer image of the fp32 score (a non-negative float
orders as its bits; a negative one as minus its magnitude's bits, so ``-0.0`` and ``0.0`` meet
at 0), the low 32 bits the reversed index. ``topk`` over unique keys has one answer, so any
top-k algorithm returns it. A sort costs ``n log n`` per row, the key a few elementwise ops: the
sort is cheaper for small rows (the router's experts, short contexts), the key for long ones
(``dsv4 bench`` figures in the README). Shapes are static and nothing is read on the host, so
every way captures into CUDA graphs and the CPU tape.
"""

from __future__ import annotations

import torch

from dsv4.native_ops import STABLE_TOPK_INTO, native_takes

__all__ = ["MAX_CANDIDATES", "NATIVE_K", "SORT_ELEMENTS", "stable_topk"]

MAX_CANDIDATES = 2**32
"""Most candidates one row may hold (the reversed index fills the key's low 32 bits)."""

SORT_ELEMENTS = 2048
"""Most scores (all rows together) ranked by a stable sort; above, by the int64 key. Measured on
one CPU thread, a sort is cheaper up to about 2 048 scores (1 x 2 048, 16 x 128) and several
times dearer from 16 x 1 024 up."""

NATIVE_K = 64
"""Most indices per row the native selection keeps (it costs up to ``k`` moves per score, so
beyond a few dozen the sort or the key win)."""

_EXACT = (torch.float32, torch.bfloat16, torch.float16)
"""Score dtypes whose values float32 holds exactly (the key is built from float32 bits)."""
_LOW = 2**32


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the ``k`` largest ``scores`` along the last dimension, largest
    first, equal scores in ascending index order (see the module docstring).

    ``scores`` are float32, bfloat16 or float16 (float32 holds them exactly); ``k`` is at most
    the row's width. Where NaN ranks is unspecified (a NaN score is a bug upstream).
    """
    if scores.dtype not in _EXACT:
        raise TypeError(
            f"stable_topk takes float32, bfloat16 or float16 scores, not {scores.dtype}"
        )
    width = scores.shape[-1]
    if width > MAX_CANDIDATES:
        raise ValueError(f"{width} candidates in a row; at most {MAX_CANDIDATES} are supported")
    if 0 < k <= min(NATIVE_K, width) and native_takes(scores):
        out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64)
        STABLE_TOPK_INTO(out, scores)
        return out
    if scores.numel() <= SORT_ELEMENTS:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return _keyed_topk(scores, k)


def _keyed_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``topk`` over the unique int64 key of each candidate (see the module docstring)."""
    width = scores.shape[-1]
    bits = scores.to(torch.float32).view(torch.int32)
    sign = bits >> 31  # -1 where the sign bit is set, else 0
    # a negative float's bits are (2**31 | magnitude): flip the magnitude, add one: -magnitude
    ordered = (bits ^ (sign & 0x7FFFFFFF)) - sign
    reversed_index = torch.arange(width - 1, -1, -1, device=scores.device)
    keys = torch.add(reversed_index, ordered, alpha=_LOW)
    return keys.topk(k, dim=-1).indices
