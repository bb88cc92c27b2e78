"""The bytes one decode step must read: the memory floor of a step, from the model and its routing.

A step cannot take less time than reading, once, every byte it needs at the machine's streaming
bandwidth (``runners.measure.floor`` measures that bandwidth). What it needs, for tokens at
positions ``p`` (one per request, each attending its own request's cache):

- **weights**: every parameter and persistent buffer a token reads whole (the model's state
  dict, shared tensors once: attention, norms, hyper-connections, routers, the shared expert,
  the head), except the three kinds below;
- **experts**: of each MoE layer's routed experts, those the step's tokens chose (each distinct
  expert once, whole: its weights, and for a weight-only stack its bytes and scales);
- **rows**: the embedding rows of the step's distinct token ids, and their rows of each hash
  layer's token-to-expert table (a table tied to the head is read whole, as a weight);
- **kv**: per attention layer and token, the cache rows it attends: its sliding window
  (``min(sliding_window, p + 1)`` keys), every compressed entry it may see (``(p + 1) // rate``;
  a CSA layer's indexer scores the indexer keys of all of them and attends the
  ``min(index_topk, visible)`` it selects, an HCA layer attends all of them).

The step's weight products (``multiply_adds``: every token times every weight element it reads
whole, and each (token, chosen expert) pair times the expert's elements) give its compute
floor; attention's products with the KV are not counted, so that floor is a lower bound too.

Not counted: activations (they stay in cache), constants derived from the config (rotary rows,
index tables: a kernel computes them in registers), the compressors' pooling state (read once
per ``rate`` tokens, when a window completes) and the writes.

``recorded_routes`` collects the experts each MoE layer's router chose during a forward, so the
count follows the actual routing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import attrs
import torch
from torch import nn

from dsv4.attention import DeepseekV4Attention
from dsv4.config import CSA, SLIDING
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.moe import ExpertFormulations, MoE, Router

__all__ = ["StepReads", "decode_reads", "recorded_routes"]


@attrs.frozen(kw_only=True)
class StepReads:
    """Bytes one decode step must read, by kind (see the module docstring)."""

    weights: int
    experts: int
    rows: int
    kv: int
    distinct_experts: tuple[int, ...]
    """Routed experts chosen per MoE layer (this rank's, with expert parallelism)."""
    multiply_adds: int = 0
    """The weight products' multiply-adds (the module docstring)."""

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.rows + self.kv

    def to_dict(self) -> dict[str, int | list[int]]:
        return {
            "weights": self.weights,
            "experts": self.experts,
            "rows": self.rows,
            "kv": self.kv,
            "total": self.total,
            "distinct_experts": list(self.distinct_experts),
            "multiply_adds": self.multiply_adds,
        }


@contextlib.contextmanager
def recorded_routes(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every forward of ``model`` appends, per MoE layer in model order, the
    experts its router chose (``[T, k]`` global indices); the list is yielded. Keeping them
    issues no op (each is a fresh output no later op writes)."""
    routes: list[torch.Tensor] = []

    def keep(module: nn.Module, inputs: object, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        routes.append(output[0])

    handles = [m.gate.register_forward_hook(keep) for m in model.modules() if isinstance(m, MoE)]
    try:
        yield routes
    finally:
        for handle in handles:
            handle.remove()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def decode_reads(
    model: DeepseekV4ForCausalLM,
    token_ids: Sequence[int],
    positions: Sequence[int],
    routes: Sequence[torch.Tensor],
) -> StepReads:
    """``StepReads`` of one decode step of ``model`` (a ``DeepseekV4ForCausalLM``): one token per
    request, ``token_ids[i]`` at ``positions[i]``; ``routes`` the step's experts per MoE layer
    (``recorded_routes``), of which the first ``len(token_ids)`` rows are the real tokens."""
    if len(token_ids) != len(positions):
        raise ValueError(f"{len(token_ids)} token ids for {len(positions)} positions")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if len(routes) != len(moes):
        raise ValueError(f"{len(routes)} routes for {len(moes)} MoE layers")
    distinct_tokens = len(set(token_ids))
    state = model.state_dict(keep_vars=True)
    whole_storages: set[int] = set()
    weights = rows = elements = 0
    row_tables: list[torch.Tensor] = []
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        owner, leaf = _owner(model, name)
        if isinstance(owner, ExpertFormulations):
            continue
        if isinstance(owner, nn.Embedding) or (isinstance(owner, Router) and leaf == "tid2eid"):
            row_tables.append(tensor)
            continue
        key = tensor.untyped_storage().data_ptr()
        whole_storages.add(key)
        if (key, tensor.storage_offset()) not in seen:
            seen.add((key, tensor.storage_offset()))
            weights += _nbytes(tensor)
            elements += tensor.numel()
    for table in row_tables:
        if table.untyped_storage().data_ptr() not in whole_storages:
            rows += distinct_tokens * _nbytes(table[0])
    experts, distinct, multiply_adds = 0, [], elements * len(token_ids)
    for moe, chosen in zip(moes, routes, strict=True):
        local = moe.local_experts
        slots = [int(e) for e in chosen[: len(token_ids)].reshape(-1).tolist() if e in local]
        picked = set(slots)
        stack = moe.experts.state_dict(keep_vars=True).values()
        per_expert = sum(_nbytes(t) for t in stack)
        experts += len(picked) * per_expert // len(local)
        multiply_adds += len(slots) * sum(t.numel() for t in stack) // len(local)
        distinct.append(len(picked))
    itemsize = torch.empty((), dtype=model.compute_dtype).element_size()
    kv = sum(_layer_kv(layer, positions, itemsize) for layer in _attention_layers(model))
    return StepReads(
        weights=weights,
        experts=experts,
        rows=rows,
        kv=kv,
        distinct_experts=tuple(distinct),
        multiply_adds=multiply_adds,
    )


def _attention_layers(model: nn.Module) -> list[DeepseekV4Attention]:
    return [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]


def _layer_kv(layer: DeepseekV4Attention, positions: Sequence[int], itemsize: int) -> int:
    """Cache bytes ``layer`` attends for tokens at ``positions`` (``itemsize``: the caches')."""
    key = layer.head_dim * itemsize
    total = sum(min(layer.sliding_window, p + 1) * key for p in positions)
    compressor = layer.compressor
    if layer.layer_type == SLIDING or compressor is None:
        return total
    for p in positions:
        visible = (p + 1) // compressor.rate
        indexer = compressor.indexer
        if layer.layer_type == CSA and indexer is not None:
            total += visible * indexer.dim * itemsize + min(indexer.topk, visible) * key
        else:
            total += visible * key
    return total
