"""``DeepseekV4ForCausalLM``: embeddings, decoder blocks with hyper-connections, HC head, LM head.

The module tree mirrors the Hugging Face implementation, so ``state_dict()`` keys are the
reference parameter names (``model.layers.{i}.self_attn.q_a_proj.weight`` ...) and a Hugging Face
checkpoint loads by name.

Contract with the runners: ``model(input_ids [T], positions [T]) -> logits [T, vocab]`` (fp32),
run inside a forward context (``graphs.forward_context``) carrying the step's attention metadata,
the paged caches (allocated by the runner with ``dsv4.cache.allocate_kv_caches``) and the eager
region every attention layer composes its region with. The model keeps none of them, so one
model may be driven by several runners in turn. Padded tokens (slot -1) give finite garbage and
write nothing.

Inference only: parameters do not require gradients (so cache writes never record autograd
history). Dtypes: the model computes in its ``compute_dtype`` (the dtype it was built with: the
embeddings', so every activation and the KV caches the runners allocate); parameters take it
except those transformers keeps in fp32 whatever the dtype (``dsv4.dtypes.keeps_float32``:
hyper-connections, sinks, position biases, the router correction bias, every norm weight); RoPE
frequencies and the compressor gate state stay fp32 too. Built with ``initialize=False`` (for
loaders), parameters are allocated once, uninitialised, directly in those dtypes.

Tensor and expert parallelism (``parallel``, a ``dsv4.parallel.TensorParallel`` of size N that
``check_parallel_size`` accepts): each rank holds its share, not a replica, and every rank
computes the same full-vocabulary logits. Split: the vocabulary (``embed_tokens`` and
``lm_head`` rows; a token's embedding comes from the rank holding its row, zeros elsewhere, then
an all-reduce; the logits are gathered over the ranks), the attention heads and output groups
(``dsv4.attention``), the routed experts and the shared expert (``dsv4.moe``). Replicated: the
single KV head, its norm, the compressors and indexers (``dsv4.attention`` says why), the routers,
every norm and the hyper-connections (they act on the full ``hidden`` streams every rank holds
after each all-reduce, and are small). Collectives per forward: one all-reduce for the
embeddings, one after each attention and one after each MoE, one all-gather of the logits.
Parameter names and meanings are those of the full model, each tensor the rank's slice
(``dsv4.sharding`` states the slices; ``shard_model`` and ``load_checkpoint`` fill them).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.attention import DeepseekV4Attention
from dsv4.config import DeepseekV4Config
from dsv4.dtypes import KEEP_IN_FP32_MODULES, keeps_float32, parameter_dtype
from dsv4.hyper import HyperConnection, HyperHead, mix
from dsv4.layers import Linear, RMSNorm, read_rows
from dsv4.materialize import materialize_parameters_, parameters_on_meta
from dsv4.moe import MoE
from dsv4.parallel import SINGLE, TensorParallel, check_parallel_size

__all__ = ["FP32_PARAMETER_MARKERS", "DeepseekV4ForCausalLM", "DeepseekV4Model"]

FP32_PARAMETER_MARKERS = KEEP_IN_FP32_MODULES
"""Substrings of parameter names kept in fp32 whatever the model dtype (as the reference)."""


class DecoderLayer(nn.Module):
    """Attention and MoE, each wrapped by a hyper-connection over the ``hc_mult`` streams."""

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        hc = {"eps": config.hc_eps, "norm_eps": eps}
        self.self_attn = DeepseekV4Attention(config, layer_idx, parallel)
        self.mlp = MoE(config, layer_idx, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(
            config.hc_mult, config.hidden_size, sinkhorn_iters=config.hc_sinkhorn_iters, **hc
        )
        self.ffn_hc = HyperConnection(
            config.hc_mult, config.hidden_size, sinkhorn_iters=config.hc_sinkhorn_iters, **hc
        )

    def forward(
        self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        post, comb_t, collapsed = self.attn_hc(streams)
        streams = mix(
            streams, post, comb_t, self.self_attn(positions, self.input_layernorm(collapsed))
        )
        post, comb_t, collapsed = self.ffn_hc(streams)
        return mix(
            streams, post, comb_t, self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        )


def _embed(table: torch.Tensor, input_ids: torch.Tensor, parallel: TensorParallel) -> torch.Tensor:
    """Rows of the vocabulary-parallel embedding ``table`` (this rank's contiguous share of the
    vocabulary): each rank contributes the rows it holds and zeros for the others, and the
    all-reduce adds them (exactly: every sum has one non-zero term)."""
    if parallel.size == 1:
        return read_rows(table, input_ids)  # one index_select
    rows = table.shape[0]
    local = input_ids - parallel.rank * rows
    inside = (local >= 0) & (local < rows)
    picked = read_rows(table, local.clamp(0, rows - 1))
    return parallel.all_reduce_(picked * inside.unsqueeze(-1).to(picked.dtype))


class DeepseekV4Model(nn.Module):
    """Embeddings, decoder layers, final hyper-connection head and norm."""

    def __init__(self, config: DeepseekV4Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hc_mult = config.hc_mult
        self.parallel = parallel
        vocab = len(parallel.share(config.vocab_size))
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(
            config.hc_mult, config.hidden_size, eps=config.hc_eps, norm_eps=config.rms_norm_eps
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = _embed(self.embed_tokens.weight, input_ids, self.parallel)
        streams = embeds.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    """The causal language model the runners drive (see the module docstring for the contract)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        initialize: bool = True,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        """``dtype``: the compute dtype (any floating dtype). ``initialize=False`` leaves every
        parameter uninitialised, allocated once in its final dtype on ``device`` (never a float32
        copy first): for loaders that fill every parameter. ``parallel``: the rank whose share
        the model holds (``check_parallel_size`` refuses a size that does not split it); an
        initialised share is *not* the slice of an initialised full model (use
        ``dsv4.sharding.shard_model`` for that)."""
        if not dtype.is_floating_point:
            raise ValueError(f"the compute dtype must be a floating dtype, not {dtype}")
        check_parallel_size(config, parallel.size)
        super().__init__()
        self.config = config
        self.parallel = parallel
        if initialize:
            self._build(config)
            self.requires_grad_(False)
            self.to(device=device)
            for name, parameter in self.named_parameters():
                if not keeps_float32(name):
                    parameter.data = parameter.data.to(dtype)
        else:
            with parameters_on_meta():
                self._build(config)
            materialize_parameters_(self, device, lambda name: parameter_dtype(name, dtype))
            self.to(device=device)

    def _build(self, config: DeepseekV4Config) -> None:
        self.model = DeepseekV4Model(config, self.parallel)
        vocab = len(self.parallel.share(config.vocab_size))
        self.lm_head = Linear(config.hidden_size, vocab)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and KV caches are in: the token embeddings' (every activation
        starts as rows of them), whatever the fp32-kept parameters are."""
        return self.model.embed_tokens.weight.dtype

    def attention_layers(self) -> list[DeepseekV4Attention]:
        return [module for module in self.modules() if isinstance(module, DeepseekV4Attention)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` in fp32 for tokens ``input_ids`` at ``positions`` (the whole
        vocabulary on every rank: the ranks' shares gathered)."""
        logits = self.lm_head(self.model(input_ids, positions))
        return self.parallel.all_gather(logits, dim=-1).float()
