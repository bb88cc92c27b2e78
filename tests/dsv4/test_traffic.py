"""``dsv4.traffic``: the bytes a decode step must read, against a count made by hand from the
tiny configuration's shapes, and the routing it is given recorded from a real forward."""

from __future__ import annotations

import attrs
import pytest
import torch

from dsv4 import DeepseekV4Config, DeepseekV4ForCausalLM
from dsv4.traffic import decode_reads, recorded_routes
from runners.engine import ScheduledChunk
from runners.spec import EngineSpec, build_engine

F32 = 4

# The tiny configuration (hidden 128, 3 layers: sliding / CSA / HCA, experts 4 x (gate_up
# 128 x 128 + down 128 x 64)), parameter elements counted by hand, module by module.
ATTENTION = 64 * 128 + 64 + 128 * 64 + 32 * 128 + 32 + 64 * 64 + 128 * 64 + 4  # 32 868
CSA_COMPRESSOR = 2 * 64 * 128 + 4 * 64 + 32  # kv/gate 2 x 32 wide, position bias, norm
CSA_INDEXER = 2 * 32 * 128 + 4 * 32 + 16 + 128 * 64 + 8 * 128  # + queries, head weights
HCA_COMPRESSOR = 2 * 32 * 128 + 16 * 32 + 32
ROUTER, SHARED_EXPERT, NORMS = 4 * 128, 3 * 64 * 128, 2 * 128
HYPER = 2 * (24 * 512 + 24 + 3)  # attention and MoE hyper-connections: fn, base, scale
LAYER = ATTENTION + ROUTER + SHARED_EXPERT + NORMS + HYPER  # 82 842
CORRECTION_BIAS = 4  # a buffer of each scored (not hashed) MoE layer
HEAD = 128 + 4 * 512 + 4 + 1 + 320 * 128  # final norm, HC head, lm_head
WEIGHTS = F32 * (
    LAYER
    + (LAYER + CSA_COMPRESSOR + CSA_INDEXER + CORRECTION_BIAS)
    + (LAYER + HCA_COMPRESSOR + CORRECTION_BIAS)
    + HEAD
)
EXPERT = F32 * (128 * 128 + 128 * 64)
EMBEDDING_ROW, HASH_ROW = F32 * 128, 8 * 2
KEY, INDEX_KEY = F32 * 32, F32 * 16


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM(DeepseekV4Config.tiny())


def test_the_hand_count_matches_the_tiny_shapes(model: DeepseekV4ForCausalLM) -> None:
    assert WEIGHTS == 1_338_540
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert F32 * experts == 3 * 4 * EXPERT


def test_decode_reads_equal_the_count_by_hand(model: DeepseekV4ForCausalLM) -> None:
    """Two requests: token 7 at position 3 (a window of 4 keys, one CSA entry, no HCA entry)
    and token 9 at position 40 (a full window of 8, ten CSA entries of which the indexer
    selects 4, two HCA entries); experts {0, 1}, {2}, {1, 3} (the hash layer chose expert 2
    twice for one token)."""
    routes = [torch.tensor([[0, 1], [1, 0]]), torch.tensor([[2, 2], [2, 2]])]
    routes.append(torch.tensor([[1, 3], [3, 1]]))
    reads = decode_reads(model, [7, 9], [3, 40], routes)
    kv_sliding = (4 + 8) * KEY
    kv_csa = (4 + 8) * KEY + (1 + 10) * INDEX_KEY + (1 + 4) * KEY
    kv_hca = (4 + 8) * KEY + (0 + 2) * KEY
    assert reads.weights == WEIGHTS
    assert reads.experts == (2 + 1 + 2) * EXPERT
    assert reads.distinct_experts == (2, 1, 2)
    assert reads.rows == 2 * (EMBEDDING_ROW + HASH_ROW)
    assert reads.kv == kv_sliding + kv_csa + kv_hca
    assert reads.total == WEIGHTS + 5 * EXPERT + 2 * (EMBEDDING_ROW + HASH_ROW) + reads.kv
    # each token multiplies every weight element it reads whole, and each of the 12 expert
    # slots (2 per token per layer, a repeated choice twice) its expert's elements
    assert reads.multiply_adds == 2 * WEIGHTS // F32 + 12 * EXPERT // F32


def test_a_repeated_token_reads_its_rows_once(model: DeepseekV4ForCausalLM) -> None:
    routes = [torch.tensor([[0, 1], [0, 1]])] * 3
    reads = decode_reads(model, [5, 5], [16, 16], routes)
    assert reads.rows == EMBEDDING_ROW + HASH_ROW
    assert reads.experts == 3 * 2 * EXPERT


def test_a_tied_embedding_is_read_whole_as_the_head() -> None:
    tied = DeepseekV4ForCausalLM(attrs.evolve(DeepseekV4Config.tiny(), tie_word_embeddings=True))
    routes = [torch.tensor([[0, 1]])] * 3
    reads = decode_reads(tied, [7], [3], routes)
    assert reads.weights == WEIGHTS  # the head's table, counted once
    assert reads.rows == HASH_ROW


def test_routes_are_what_each_router_chose_in_a_real_step() -> None:
    """The routing recorded in an eager step is each MoE layer's choice for every token: the
    hash layer's is its table's rows, a scored layer's two distinct experts per token."""
    runner = build_engine(EngineSpec(cudagraph_mode="NONE")).runner
    ids = [3, 200, 57]
    chunks = [
        ScheduledChunk(row=row, block_ids=(row,), start_position=0, num_tokens=1)
        for row in range(3)
    ]
    with recorded_routes(runner.model) as routes:
        runner.execute(chunks, [[t] for t in ids])
    assert len(routes) == 3 and all(r.shape == (3, 2) for r in routes)
    table = runner.model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(routes[0], table[torch.tensor(ids)])
    for scored in routes[1:]:
        assert all(len(set(row)) == 2 and set(row) <= {0, 1, 2, 3} for row in scored.tolist())
