"""Logits of a few steps of the built-in tiny model on one thread, written to a file: run by
``test_native_isas`` once as is and once with ``DSV4_BASELINE_KERNELS`` set.

The steps take every native kernel the decode path has: prefills of 9 tokens (products in
panels, routed experts of 9 rows), decode steps of 1 and 6 requests (skinny products, fused
hyper-connections and shared experts; products in panels). (Graphs replay the same kernels.)"""

from __future__ import annotations

import sys

import torch

from runners.measure.benchmark import decode_token_ids, prefill_requests
from runners.spec import EngineSpec, build_engine


def main(path: str) -> None:
    engine = build_engine(EngineSpec(threads=1))
    runner = engine.runner
    steps = []
    for batch in (1, 6):
        chunks = prefill_requests(runner, batch, 9)
        steps.append(runner.execute(chunks, decode_token_ids(batch)))
    torch.save(steps, path)


if __name__ == "__main__":
    main(sys.argv[1])
