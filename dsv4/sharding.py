"""Which slice of each full-model tensor a tensor-parallel rank holds, and taking it.

The one statement of the split (``dsv4.model`` says why these and no others); every tensor not
listed is replicated. A split tensor is cut into ``N`` equal contiguous parts along one
dimension and rank ``r`` holds part ``r``:

- dimension 0: ``model.embed_tokens.weight`` and ``lm_head.weight`` (vocabulary rows), a
  layer's ``self_attn.q_b_proj.weight`` (its heads' rows), ``self_attn.sinks`` (its heads),
  ``self_attn.o_a_proj.weight`` (its output groups' rows), the routed expert stacks
  ``mlp.experts.gate_up_proj``/``down_proj`` (its experts) and the shared expert's
  ``gate_proj``/``up_proj`` weights (its intermediate rows);
- dimension 1: ``self_attn.o_b_proj.weight`` and the shared expert's ``down_proj.weight``
  (row-parallel: the inputs its other slices produce).

The same names with the weight-only buffers' leaves (``weight``, ``weight_scale_inv``) are the
same split (``parameter_bytes`` counts them so). ``RankShare.split`` gives the slice of one
tensor, ``shard_model`` the rank's share of a built full model, ``parameter_bytes`` what a model
holds, split and replicated apart.
"""

from __future__ import annotations

import re

import attrs
import torch

from dsv4.config import DeepseekV4Config
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.parallel import TensorParallel
from dsv4.shard_reader import Index

__all__ = [
    "ParameterBytes",
    "RankShare",
    "Split",
    "parameter_bytes",
    "shard_model",
    "split_dim",
]

_LEAF = r"(\.weight|\.weight_scale_inv)"
_SPLIT_DIMS = tuple(
    (re.compile(pattern), dim)
    for pattern, dim in (
        (rf"^model\.embed_tokens{_LEAF}$", 0),
        (rf"^lm_head{_LEAF}$", 0),
        (rf"\.self_attn\.q_b_proj{_LEAF}$", 0),
        (r"\.self_attn\.sinks$", 0),
        (rf"\.self_attn\.o_a_proj{_LEAF}$", 0),
        (rf"\.self_attn\.o_b_proj{_LEAF}$", 1),
        (rf"\.mlp\.experts\.(gate_up_proj|down_proj){_LEAF}?$", 0),
        (rf"\.mlp\.shared_experts\.(gate_proj|up_proj){_LEAF}$", 0),
        (rf"\.mlp\.shared_experts\.down_proj{_LEAF}$", 1),
    )
)


def split_dim(name: str) -> int | None:
    """The dimension along which model tensor ``name`` (canonical) is split; ``None`` when it is
    replicated."""
    for pattern, dim in _SPLIT_DIMS:
        if pattern.search(name):
            return dim
    return None


@attrs.frozen
class Split:
    """A rank's part ``start .. stop - 1`` of dimension ``dim`` of a full tensor."""

    dim: int
    start: int
    stop: int

    def stored_index(self, index: Index, ndim: int) -> Index:
        """The index into the full tensor of what ``index`` selects of the part: a full-length
        index of integers and slices (safetensors ``get_slice`` takes it as it is)."""
        full: list[int | slice] = [*index, *(slice(None),) * (ndim - len(index))]
        at = full[self.dim]
        if isinstance(at, int):
            full[self.dim] = self.start + at
        else:
            begin, end, _ = at.indices(self.stop - self.start)
            full[self.dim] = slice(self.start + begin, self.start + end)
        return tuple(full)


@attrs.frozen
class RankShare:
    """What rank ``parallel`` of a model of ``config`` holds."""

    config: DeepseekV4Config
    parallel: TensorParallel

    @property
    def experts(self) -> range:
        """The routed experts this rank holds (global ids, contiguous)."""
        return self.parallel.share(self.config.n_routed_experts)

    def split(self, name: str, local_shape: tuple[int, ...] | torch.Size) -> Split | None:
        """The part of full tensor ``name`` a tensor of ``local_shape`` holds on this rank;
        ``None`` for a replicated tensor or a single rank (the whole tensor)."""
        dim = split_dim(name) if self.parallel.size > 1 else None
        if dim is None:
            return None
        length = local_shape[dim]
        return Split(dim, self.parallel.rank * length, (self.parallel.rank + 1) * length)

    def full_shape(self, name: str, local_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """The full model's shape of tensor ``name`` that this rank holds as ``local_shape``."""
        shape = list(local_shape)
        dim = split_dim(name) if self.parallel.size > 1 else None
        if dim is not None:
            shape[dim] *= self.parallel.size
        return tuple(shape)


@torch.no_grad()
def shard_model(full: DeepseekV4ForCausalLM, parallel: TensorParallel) -> DeepseekV4ForCausalLM:
    """Rank ``parallel``'s share of ``full`` (a model of plain parameters, one rank): a new model
    whose every tensor is its slice of ``full``'s (``RankShare.split``), in the same dtypes on the
    same device, so every rank's weights are bit for bit those of the full model."""
    if full.parallel.size != 1:
        raise ValueError(f"shard_model takes a full model, not rank {full.parallel.rank}'s share")
    device = next(full.parameters()).device
    model = DeepseekV4ForCausalLM(
        full.config,
        device=device,
        dtype=full.compute_dtype,
        initialize=False,
        parallel=parallel,
    )
    share = RankShare(full.config, parallel)
    source = full.state_dict()
    for name, target in model.state_dict(keep_vars=True).items():
        whole = source.get(name)
        expected = share.full_shape(name, target.shape)
        if whole is None or tuple(whole.shape) != expected or whole.dtype != target.dtype:
            raise ValueError(
                f"shard_model takes a model of plain parameters: {name!r} is "
                f"{'missing' if whole is None else f'{whole.dtype} {list(whole.shape)}'}, "
                f"expected {target.dtype} {list(expected)} (load a quantized checkpoint with "
                "load_checkpoint(..., parallel=...))"
            )
        split = share.split(name, target.shape)
        target.copy_(whole if split is None else whole[split.stored_index((), whole.dim())])
    return model.eval()


@attrs.frozen
class ParameterBytes:
    """Bytes of a model's parameters and persistent buffers (its state dict, shared tensors
    once): the split tensors (``split_dim``) and the replicated ones."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def parameter_bytes(model: torch.nn.Module) -> ParameterBytes:
    """What ``model`` holds (see ``ParameterBytes``), quantized weight-only buffers included."""
    seen: set[int] = set()
    sharded = replicated = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = tensor.untyped_storage().data_ptr() + tensor.storage_offset()
        if key in seen:
            continue
        seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if split_dim(name) is None:
            replicated += nbytes
        else:
            sharded += nbytes
    return ParameterBytes(sharded=sharded, replicated=replicated)
