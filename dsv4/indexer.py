"""The lightning indexer of a CSA layer: picks, per query, which compressed entries it attends.

Keys ``K_I[s]`` come from its own overlapping compressor at ``index_head_dim`` (RoPE at
``s*m``); queries ``q_I = q_b_proj(q_res)`` are ``[index_n_heads, index_head_dim]``, rotated at
the query position, not normalised. Weights ``w_h = weights_proj(x)[h] / sqrt(n_I)``. The
score of entry ``s`` for query ``t`` is ``sum_h w_h * relu(q_I[h] . K_I[s]) / sqrt(c_I)`` in
fp32; entries not yet complete score ``-inf``; the top ``min(index_topk, capacity)`` entries
are selected and those that are not visible are marked invalid. On the CPU (float32, one thread)
the scores are one native op (``dsv4::index_scores_into``). Among equal scores the entry
with the lower index in the request (the earlier entry) wins, and selected entries come in
descending order of score, then ascending index (``dsv4.selection.stable_topk``): exact ties
are common (an entry scores 0.0 wherever every head's ReLU is zero), and the rule makes the
choice independent of how wide the row is, so graphs of any context bucket, any prefill
chunking and any batch choose alike.

Selecting over the static capacity (the request's maximum context / m) instead of the number
of entries that exist picks the same visible set as the reference (which takes
``min(index_topk, existing)``), because invisible entries (``-inf``, below every visible
score) can only fill places left after every visible entry is taken. It keeps every shape
static, so selection needs no host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.layers import Linear, as_dtype
from dsv4.native_ops import INDEX_SCORES_INTO, native_takes
from dsv4.pooling import WindowPooler
from dsv4.rope import RotaryEmbedding, RotaryTables
from dsv4.selection import stable_topk

__all__ = ["Indexer", "IndexerScorer"]


def _native_scores(
    queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
) -> bool:
    """Whether the scores are one native op: float32 on one CPU thread, a boolean mask."""
    return (
        torch.get_num_threads() == 1
        and visible.dtype == torch.bool
        and visible.is_contiguous()
        and native_takes(queries, keys, weights)
    )


class IndexerScorer(nn.Module):
    """Holds ``weights_proj`` (reference name ``indexer.scorer.weights_proj``)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden_size, num_heads)


class Indexer(WindowPooler):
    """Key compressor plus query projection and head weights of the lightning indexer."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        *,
        num_heads: int,
        head_dim: int,
        rate: int,
        topk: int,
        eps: float,
    ) -> None:
        super().__init__(hidden_size, head_dim, rate, overlap=True, eps=eps)
        self.num_heads = num_heads
        self.topk = topk
        self.q_b_proj = Linear(q_lora_rank, num_heads * head_dim)
        self.scorer = IndexerScorer(hidden_size, num_heads)

    def queries(
        self,
        hidden_states: torch.Tensor,
        q_residual: torch.Tensor,
        heads: RotaryTables,
        rope: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[T, n_I, c_I]`` rotated by ``heads`` (the query positions' per-head rows)
        and fp32 head weights ``[T, n_I]``."""
        q = self.q_b_proj(q_residual).unflatten(-1, (self.num_heads, self.dim))
        q = rope.rotate(q, heads.last(self.dim))
        weights = as_dtype(self.scorer.weights_proj(hidden_states), torch.float32)
        weights = weights * self.num_heads**-0.5
        return q, weights

    def select(
        self,
        queries: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Selected entry indices ``[T, k]`` among the ``keys`` ``[T, capacity, c_I]`` of every
        entry of each token's request (column ``s`` is the request's entry ``s``), of which
        ``visible`` ``[T, capacity]`` are complete; ties go to the lower entry index."""
        fp32 = torch.float32
        queries, keys = as_dtype(queries, fp32), as_dtype(keys, fp32)
        if _native_scores(queries, weights, keys, visible):  # on the CPU: one op
            # (also for bf16 models, on float32 copies: a matrix product's sums may depend on
            # how many entries the step's widest request has, and decide the top-k)
            scores = queries.new_empty(visible.shape)
            INDEX_SCORES_INTO(scores, queries, keys, weights, visible, self.dim**-0.5)
            return stable_topk(scores, min(self.topk, keys.shape[1]))
        scores = torch.einsum("thd,tsd->ths", queries, keys)
        scores = (scores.relu_() * self.dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)
        scores = torch.where(visible, scores, float("-inf"))
        return stable_topk(scores, min(self.topk, keys.shape[1]))
