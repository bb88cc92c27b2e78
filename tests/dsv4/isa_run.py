"""What ``test_isas`` compares across instruction sets, computed in one process and written to
a file: run once per instruction set the CPU has, with ``dsv4_isa.environment_for`` it.

- ``steps``: the logits of every step of four prompts (9 to 300 tokens) on the built-in tiny
  model, one 512-token budget and one of 64 (prefill chunks of a few rows, of a block of
  panel rows and of several blocks; decode steps of 1 to 4 requests): every native kernel.
- ``matrix``: ``dsv4 matrix --platform cpu --json``'s cells (status, max diff).
- ``ties``: the tie suite's runs (``tests/runners/test_chunked_prefill_ties``): tokens and the
  last prompt token's logits at every budget, alone and batched, float32 and bfloat16.
- ``docs``: what every ``$ dsv4 …`` example of the README and ``docs/`` prints (``timing:``
  numbers masked), keyed by page and command.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import dsv4_isa

ISA = dsv4_isa.apply_requested()

import torch  # noqa: E402

from runners.cli.main import main as dsv4_main  # noqa: E402
from runners.engine import SamplingParams  # noqa: E402
from runners.spec import EngineSpec, build_engine  # noqa: E402
from tests.readme.examples import Outputs, comparable, examples  # noqa: E402
from tests.runners.test_chunked_prefill_ties import (  # noqa: E402
    BUDGETS,
    OTHER,
    PROMPT,
    build_tying_model,
    in_dtype,
    run_budget,
)

PROMPT_LENGTHS = (9, 200, 70, 300)


def steps(budget: int) -> list[torch.Tensor]:
    engine = build_engine(EngineSpec(threads=1, max_num_tokens=budget, cudagraph_mode="NONE"))
    logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(chunks, token_ids):  # type: ignore[no-untyped-def]
        out = execute(chunks, token_ids)
        logits.append(out.clone())
        return out

    engine.runner.execute = recording  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    engine.llm.generate(prompts, SamplingParams(max_tokens=4))
    return logits


def matrix() -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = dsv4_main(["matrix", "--platform", "cpu", "--json"])
    assert code == 0, f"dsv4 matrix exited {code}"
    keys = ("runner", "eager_region", "cudagraph_mode", "status", "max_abs_diff")
    return [{k: cell[k] for k in keys} for cell in json.loads(out.getvalue())["cells"]]


def ties() -> dict[str, Any]:
    model = build_tying_model()
    runs: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        converted = in_dtype(model, dtype)
        for budget in BUDGETS:
            runs[f"{dtype} {budget} alone"] = run_budget(converted, budget, [PROMPT])
            runs[f"{dtype} {budget} batched"] = run_budget(converted, budget, [PROMPT, OTHER])
    return runs


def docs() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        outputs = Outputs(Path(scratch))
        return {f"{e.block.where} {e.line}": comparable(outputs.of(e)) for e in examples()}


def main(path: str) -> None:
    torch.save(
        {
            "isa": ISA,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "steps": [steps(512), steps(64)],
            "matrix": matrix(),
            "ties": ties(),
            "docs": docs(),
        },
        path,
    )


if __name__ == "__main__":
    main(sys.argv[1])
