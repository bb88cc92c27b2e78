"""A 4 096-token prompt, chunked through the engine with context-bucketed graphs, gives
transformers' greedy tokens and logits (the tiny config, declaring 8 192 positions)."""

from __future__ import annotations

import attrs
import torch

from dsv4.config import DeepseekV4Config
from dsv4.testing import random_model
from runners.engine import SamplingParams
from runners.spec import EngineSpec, build_engine
from tests.dsv4.support import hf_twin

PROMPT_TOKENS = 4096
NEW_TOKENS = 4


def test_a_4096_token_prompt_gives_transformers_greedy_tokens() -> None:
    config = attrs.evolve(DeepseekV4Config.tiny(), max_position_embeddings=8192)
    model = random_model(config, 11)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (PROMPT_TOKENS,), generator=generator).tolist()

    hf = hf_twin(model)
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    expected = hf_out.sequences[0, PROMPT_TOKENS:].tolist()
    hf_first = hf_out.logits[0][0].float()

    engine = build_engine(
        EngineSpec(
            platform="cpu",
            max_model_len=PROMPT_TOKENS + NEW_TOKENS,
            max_num_seqs=1,
            max_num_tokens=256,
            capture_sizes=(1, 2, 4),
            first_context_bucket=1024,
        ),
        model=model,
    )
    # buckets of 1024, 2048, 4096 and 4100 tokens; decoding replays the largest's FULL graph
    assert [w * 16 for w in engine.runner.context_buckets.widths] == [1024, 2048, 4096, 4112]
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(*args: object) -> torch.Tensor:
        logits = execute(*args)  # type: ignore[arg-type]
        seen.append(logits.clone())
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    (output,) = engine.llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS))
    assert list(output.output_ids) == expected
    # the last prefill step's logits at the prompt's last token
    assert float((seen[PROMPT_TOKENS // 256 - 1][0] - hf_first).abs().max()) <= 1e-4
    assert any(key.width == engine.runner.context_buckets.largest for key in engine.runner.captured)
