"""transformers as a tie-aware oracle: its top-k choices follow the model's tie rule, and every
choice so made is checked to differ from ``torch.topk``'s own only among exactly equal scores.

transformers picks the indexer's entries (``DeepseekV4Indexer``: ``index_scores.topk``) and the
router's experts (``DeepseekV4TopKRouter``: ``torch.topk``) with ``torch.topk``, which keeps
no order among equal scores and picks differently for different row widths (REFERENCE §B).
Where a tie straddles the cut, its choice is one of several equally valid ones, and our model
makes a different, fixed one: the lower index wins (``dsv4.selection.stable_topk``). So the
oracle is run with its score tensors wrapped in ``TieAwareScores``: their ``topk`` runs
``torch.topk`` *and* ``stable_topk`` on the same scores, requires that both chose the same
multiset of score values (so they differ only in which of several exactly equal scores they
took), and returns the rule's choice. Everything else — every score, every other op — is
transformers' own. ``TieStats`` counts the rows where the rule chose other entries than
``torch.topk`` did: the ties that decided something.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
import transformers
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_modeling

from dsv4.selection import stable_topk

__all__ = ["TieAwareScores", "TieStats", "tie_aware"]


@attrs.define
class TieStats:
    """What the tie rule changed in one transformers model (mutable: counted per call)."""

    rows: int = 0
    """Rows (queries or tokens) whose top-k was taken."""
    decided: int = 0
    """Rows where the rule chose other candidates of finite score than ``torch.topk`` (among
    tied scores: anything else fails the check)."""


class TieAwareScores(torch.Tensor):
    """Scores whose ``topk`` follows ``stable_topk`` (checked against ``torch.topk``); every
    other op runs as on a plain tensor (its results stay ``TieAwareScores``)."""

    stats: TieStats

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.topk or func is torch.Tensor.topk:
            return _rule_topk(cls.stats, *args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs or {})


def _rule_topk(
    stats: TieStats,
    scores: torch.Tensor,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
) -> torch.return_types.topk:
    assert largest, "transformers' DeepSeek-V4 takes the largest scores"
    rows = scores.as_subclass(torch.Tensor).movedim(dim, -1)
    theirs = torch.topk(rows, k, dim=-1, sorted=sorted)
    chosen = stable_topk(rows, k)
    values = rows.gather(-1, chosen)
    if not torch.equal(theirs.values.sort(dim=-1).values, values.sort(dim=-1).values):
        raise AssertionError(
            "the tie rule chose other scores than torch.topk, not only other tied entries: "
            f"{theirs.values.tolist()} vs {values.tolist()}"
        )
    stats.rows += math.prod(rows.shape[:-1])
    stats.decided += int(_real_choices_differ(theirs.values, theirs.indices, values, chosen).sum())
    return torch.return_types.topk((values.movedim(-1, dim), chosen.movedim(-1, dim)))


def _real_choices_differ(
    their_values: torch.Tensor,
    their_indices: torch.Tensor,
    our_values: torch.Tensor,
    our_indices: torch.Tensor,
) -> torch.Tensor:
    """Rows where the two choices differ in a candidate of finite score (a choice among
    ``-inf`` ones, the entries a query may not see, decides nothing)."""

    def real(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return torch.where(values > float("-inf"), indices, -1).sort(dim=-1).values

    return (real(their_values, their_indices) != real(our_values, our_indices)).any(dim=-1)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def tie_aware(hf: transformers.DeepseekV4ForCausalLM) -> TieStats:
    """Make ``hf``'s top-k choices follow the tie rule (idempotent); return its counts."""
    existing = getattr(hf, "_tie_stats", None)
    if isinstance(existing, TieStats):
        return existing
    stats = TieStats()
    scores_type = type("TieAwareScores", (TieAwareScores,), {"stats": stats})

    def wrap_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.as_subclass(scores_type)

    def wrap_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0].as_subclass(scores_type), *args[1:])

    def unwrap_output(module: nn.Module, args: Any, output: Any) -> Any:
        return _plain(output)

    for module in hf.modules():
        if isinstance(module, hf_modeling.DeepseekV4IndexerScorer):
            module.register_forward_hook(wrap_output)
        elif isinstance(module, hf_modeling.DeepseekV4Indexer):
            module.register_forward_hook(unwrap_output)
        elif isinstance(module, hf_modeling.DeepseekV4TopKRouter):
            module.register_forward_pre_hook(wrap_input)
            module.register_forward_hook(unwrap_output)
    hf._tie_stats = stats  # type: ignore[assignment]
    return stats
