"""Test support for the model, shipped in the package: a runner-free harness and hypothesis
strategies for configs and prompts (test-time only: needs hypothesis).

``run_schedule`` teacher-forces a list of prompts through ``DeepseekV4ForCausalLM`` step by
step — each step a batch of chunks, one per request that still has tokens — and returns every
token's logits per prompt. With one chunk per prompt that is a batched prefill; with random
chunk sizes it is chunked prefill; with chunks of one it is token-by-token decode; prompts of
different lengths and chunkings put requests at different positions in the same batch. Blocks
and block-table rows are assigned in a shuffled order so paging is really exercised, and a
batch may be padded (padded tokens have slot -1). Runners own scheduling for real; the harness
exists so that tests can compare cached paths against an uncached reference.

The strategies are the one definition of random models and prompts: the model's own tests,
the runner tests and the platform conformance kit (``runners.testing``) all draw from them.
Configs are tiny (hidden <= 32, <= 3 layers) so one example costs well under a second, yet they
mix all three layer types, windows shorter and longer than the prompts, CSA rates down to 1 and
lowered HCA rates, YaRN on and off (in both RoPE parts), rotary fractions, ``o_groups``, MoE
shapes, hash and top-k routing, and both scoring functions.

They draw ties on purpose. An indexer entry scores exactly 0.0 when ReLU zeroes every head
(probability about ``2**-heads`` per token and entry), so exact ties at the top-k cut are
common with few heads, and every path must break them alike (``dsv4.selection``): configs draw
1-4 indexer heads as often as 16-18, and ``random_model`` can zero the indexer's head weights
(``INDEXER_WEIGHTS``: all but one head, or every head, so that every score is 0.0 and the tie
rule alone chooses); ``ROUTER_WEIGHTS`` can make every expert score alike, so the tie rule
alone routes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs
import torch
from hypothesis import assume
from hypothesis import strategies as st

from dsv4.cache import allocate_kv_caches, entry_rate
from dsv4.config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from dsv4.metadata import new_metadata
from dsv4.model import DeepseekV4ForCausalLM
from dsv4.parallel import SINGLE, TensorParallel
from dsv4.sharding import shard_model
from dsv4.weights import randomize_
from graphs import ForwardContext, forward_context

__all__ = [
    "INDEXER_WEIGHTS",
    "ROUTER_WEIGHTS",
    "VOCAB",
    "Chunk",
    "chunk_schedule",
    "chunk_sizes",
    "configs",
    "indexer_weights",
    "layer_types",
    "prompt_batches",
    "prompts",
    "random_model",
    "router_weights",
    "run_schedule",
    "yarns",
]

VOCAB = 64
"""Vocabulary of the drawn configs (and default range of the drawn prompts)."""


@attrs.frozen(kw_only=True)
class Chunk:
    """One request's tokens in a step, for driving the model without an engine (any object
    with these five attributes will do: ``dsv4.metadata.ChunkLike``)."""

    row: int
    block_ids: tuple[int, ...]
    entry_block_ids: tuple[int, ...]
    start_position: int
    num_tokens: int = attrs.field(validator=attrs.validators.gt(0))


Step = Sequence[tuple[int, int]]
"""One step: ``(request index, number of tokens)`` pairs, at most one per request."""


def chunk_schedule(chunk_sizes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """Steps where step ``s`` holds chunk ``s`` of every request that still has one."""
    steps: list[list[tuple[int, int]]] = []
    for s in range(max((len(c) for c in chunk_sizes), default=0)):
        steps.append([(r, sizes[s]) for r, sizes in enumerate(chunk_sizes) if s < len(sizes)])
    return steps


def run_schedule(
    model: DeepseekV4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    steps: Sequence[Step],
    *,
    block_size: int = 4,
    pad_to_multiple: int = 1,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Logits ``[len(prompt), vocab]`` of every prompt, computed through ``steps``."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    rate = entry_rate(model.config)
    needs = [math.ceil(len(p) / block_size) for p in prompts]
    blocks, num_blocks = _shuffled_blocks(needs, rng)
    entry_needs = [math.ceil(len(p) // rate / block_size) for p in prompts]
    entry_blocks, num_entry_blocks = _shuffled_blocks(entry_needs, rng)
    max_blocks = max(needs)
    rows = list(range(len(prompts)))
    rng.shuffle(rows)
    caches = allocate_kv_caches(
        model.config,
        num_blocks=num_blocks,
        block_size=block_size,
        num_entry_blocks=num_entry_blocks,
        device=device,
        dtype=model.compute_dtype,
    )

    done = [0] * len(prompts)
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        chunks: list[Chunk] = []
        ids: list[int] = []
        for request, count in step:
            begin = done[request]
            if count < 1 or begin + count > len(prompts[request]):
                raise ValueError(
                    f"step asks for tokens {begin}..{begin + count} of request {request}"
                )
            chunks.append(
                Chunk(
                    row=rows[request],
                    block_ids=blocks[request],
                    entry_block_ids=entry_blocks[request],
                    start_position=begin,
                    num_tokens=count,
                )
            )
            ids.extend(prompts[request][begin : begin + count])
            done[request] += count
        padded = math.ceil(len(ids) / pad_to_multiple) * pad_to_multiple
        metadata, positions = new_metadata(
            chunks,
            num_tokens=padded,
            block_size=block_size,
            max_rows=len(prompts),
            max_blocks=max_blocks,
            entry_rate=rate,
            device=device,
        )
        input_ids = torch.tensor(ids + [0] * (padded - len(ids)), device=device)
        ctx = ForwardContext(attn_metadata=metadata, kv_caches=caches)
        with torch.inference_mode(), forward_context(ctx):
            logits = model(input_ids, positions)
        offset = 0
        for request, count in step:
            outputs[request].append(logits[offset : offset + count])
            offset += count
    unfinished = [r for r, p in enumerate(prompts) if done[r] != len(p)]
    if unfinished:
        raise ValueError(f"the schedule leaves requests {unfinished} unfinished")
    return [torch.cat(parts) for parts in outputs]


def _shuffled_blocks(needs: Sequence[int], rng: random.Random) -> tuple[list[tuple[int, ...]], int]:
    """Disjoint blocks of a shuffled pool, ``needs[i]`` for request ``i``, and the pool's size
    (one spare block, so no id is special)."""
    pool = list(range(sum(needs) + 1))
    rng.shuffle(pool)
    blocks, start = [], 0
    for need in needs:
        blocks.append(tuple(pool[start : start + need]))
        start += need
    return blocks, len(pool)


INDEXER_WEIGHTS = ("random", "one-head", "zero")
"""How ``random_model`` draws each indexer's head weights (``scorer.weights_proj``): like every
other matrix; all rows but the first zero (an entry scores 0.0 wherever one ReLU is zero, half
of them); or every row zero (every score is 0.0: the tie rule alone chooses)."""

ROUTER_WEIGHTS = ("random", "equal")
"""How ``random_model`` draws each router: like every other matrix, or a zero row for every
expert and no score correction, so every expert scores exactly alike (a zero logit in any batch
shape; equal non-zero rows would not do: a one-row ``F.linear`` rounds identical rows
differently) and the tie rule alone routes."""


def random_model(
    config: DeepseekV4Config,
    seed: int,
    device: torch.device | str = "cpu",
    parallel: TensorParallel = SINGLE,
    *,
    indexer: str = "random",
    router: str = "random",
) -> DeepseekV4ForCausalLM:
    """A model of ``config`` with random unit-scale weights, a pure function of ``seed``,
    ``indexer`` (``INDEXER_WEIGHTS``) and ``router`` (``ROUTER_WEIGHTS``); with ``parallel``,
    rank ``parallel``'s share of that same model (``shard_model``)."""
    if indexer not in INDEXER_WEIGHTS or router not in ROUTER_WEIGHTS:
        raise ValueError(f"unknown weight draw: indexer {indexer!r}, router {router!r}")
    model = DeepseekV4ForCausalLM(config, device=device)
    randomize_(model, seed, num_experts=config.n_routed_experts)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if indexer != "random" and name.endswith("indexer.scorer.weights_proj.weight"):
                parameter[0 if indexer == "zero" else 1 :].zero_()
            if router == "equal" and name.endswith("mlp.gate.weight"):
                parameter.zero_()
        for name, buffer in model.named_buffers():
            if router == "equal" and name.endswith("e_score_correction_bias"):
                buffer.zero_()
    return model.eval() if parallel.size == 1 else shard_model(model, parallel)


indexer_weights = st.sampled_from(INDEXER_WEIGHTS)
"""Draws ``random_model``'s ``indexer`` argument."""
router_weights = st.sampled_from(ROUTER_WEIGHTS)
"""Draws ``random_model``'s ``router`` argument."""


yarns = st.none() | st.builds(
    YarnScaling,
    factor=st.sampled_from([2.0, 4.0, 8.0]),
    original_max_position_embeddings=st.sampled_from([16, 32, 64]),
    beta_fast=st.sampled_from([32.0, 8.0]),
    beta_slow=st.sampled_from([1.0, 2.0]),
    attention_factor=st.sampled_from([1.0, 1.1]),
)


def layer_types(layers: int) -> st.SearchStrategy[list[str]]:
    """Distinct types in random order (so every type is common), or any mix with repeats."""
    distinct = st.permutations([SLIDING, CSA, HCA]).map(lambda types: types[:layers])
    mixed = st.lists(st.sampled_from([SLIDING, CSA, HCA]), min_size=layers, max_size=layers)
    return distinct | mixed


@st.composite
def configs(draw: st.DrawFn, *, max_layers: int = 3, parallel: int = 1) -> DeepseekV4Config:
    """A random tiny configuration (every constraint of the config satisfied) that a
    tensor-parallel size ``parallel`` up to 8 splits (output groups and routed experts are
    multiples of it; the vocabulary, 64, and the intermediate sizes, 8 or 16, divide it);
    ``parallel=1`` draws exactly as before."""
    layers = draw(st.integers(1, max_layers))
    o_groups = parallel * draw(st.integers(1, 2))
    heads = o_groups * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([8, 12, 16]))
    rope_dim = draw(st.sampled_from([d for d in (2, 4, 6, 8) if d <= head_dim]))
    factor = rope_dim / head_dim
    assume(int(head_dim * factor) == rope_dim)
    experts = parallel * draw(st.integers(1, max(1, 5 // parallel)))
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=draw(st.sampled_from([16, 32])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=draw(st.sampled_from([8, 16])),
        o_groups=o_groups,
        o_lora_rank=draw(st.sampled_from([4, 8])),
        partial_rotary_factor=factor,
        sliding_window=draw(st.integers(1, 12)),
        layer_types=tuple(draw(layer_types(layers))),
        compress_rate_csa=draw(st.integers(1, 4)),
        compress_rate_hca=draw(st.integers(2, 8)),
        index_n_heads=draw(st.integers(1, 4) | st.integers(16, 18)),
        index_head_dim=draw(st.sampled_from([d for d in (8, 12) if d >= rope_dim])),
        index_topk=draw(st.integers(1, 6)),
        rope_theta=draw(st.sampled_from([10000.0, 500.0])),
        compress_rope_theta=draw(st.sampled_from([160000.0, 1000.0])),
        main_yarn=draw(yarns),
        compress_yarn=draw(yarns),
        hc_mult=draw(st.integers(1, 3)),
        hc_sinkhorn_iters=draw(st.integers(1, 6)),
        mlp_layer_types=tuple(
            draw(st.lists(st.sampled_from(["hash_moe", "moe"]), min_size=layers, max_size=layers))
        ),
        moe_intermediate_size=draw(st.sampled_from([8, 16])),
        n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(experts, 3))),
        scoring_func=draw(st.sampled_from(["sqrtsoftplus", "sigmoid"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 1.5])),
        swiglu_limit=draw(st.sampled_from([10.0, 0.5])),
        max_position_embeddings=128,
        tie_word_embeddings=draw(st.booleans()),
    )


def prompts(
    min_len: int = 1, max_len: int = 40, *, vocab_size: int = VOCAB
) -> st.SearchStrategy[list[int]]:
    """Token lists whose length is drawn first (plain lists would be mostly very short)."""
    tokens = st.integers(0, vocab_size - 1)
    return st.integers(min_len, max_len).flatmap(lambda n: st.lists(tokens, min_size=n, max_size=n))


def prompt_batches(
    *, max_requests: int = 3, max_len: int = 13, vocab_size: int = VOCAB
) -> st.SearchStrategy[list[list[int]]]:
    """Batches of 1 .. ``max_requests`` prompts of different lengths (1 .. ``max_len`` tokens)."""
    prompt = st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_len)
    return st.lists(prompt, min_size=1, max_size=max_requests)


def chunk_sizes(length: int, max_chunk: int) -> st.SearchStrategy[list[int]]:
    """A random split of ``length`` tokens into chunks of at most ``max_chunk``."""

    @st.composite
    def split(draw: st.DrawFn) -> list[int]:
        sizes, left = [], length
        while left:
            size = draw(st.integers(1, min(left, max_chunk)))
            sizes.append(size)
            left -= size
        return sizes

    return split()
