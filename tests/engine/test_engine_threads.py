"""One engine shared by threads: calls are serialised, and each returns what it would alone.

The interpreter is made to switch threads every microsecond, so unsynchronised calls would
interleave inside a step (they used to fail with "row 0: 0 token ids for 1" on the real runner).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from runners.engine import LLM, RequestOutput, SamplingParams
from tests.engine.reference import ReferenceExecutor, reference_generate
from tests.engine.test_engine import assert_all_free

VOCAB = 16
THREADS = 2
CALLS = 10
MAX_STEPS = 100_000
"""A bound on the step loop, so a regression fails instead of hanging."""
PARAMS = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=3, temperature=0.8, seed=11)]


@pytest.fixture(autouse=True)
def eager_thread_switches() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def prompts(thread: int, call: int) -> list[list[int]]:
    return [[(thread * 7 + call + i) % VOCAB for i in range(1 + (call + j) % 5)] for j in range(2)]


def want(thread: int, call: int) -> list[tuple[int, ...]]:
    return [
        reference_generate(p, sp, VOCAB)[0]
        for p, sp in zip(prompts(thread, call), PARAMS, strict=True)
    ]


def test_generate_from_two_threads_equals_the_single_thread_reference() -> None:
    llm = LLM(ReferenceExecutor(max_rows=2, max_num_tokens=4, block_size=2, num_blocks=16))
    start = threading.Barrier(THREADS, timeout=30)

    def calls(thread: int) -> list[list[RequestOutput]]:
        start.wait()
        return [llm.generate(prompts(thread, c), PARAMS) for c in range(CALLS)]

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(calls, range(THREADS)))
    for thread, outputs in enumerate(results):
        got = [[o.output_ids for o in call] for call in outputs]
        assert got == [want(thread, c) for c in range(CALLS)]
    assert_all_free(llm)


def test_a_step_loop_and_generate_in_other_threads_each_get_their_own_outputs() -> None:
    """Requests added from one thread may finish inside another thread's ``generate``; they are
    still delivered to the ``step`` caller, exactly once."""
    llm = LLM(ReferenceExecutor(max_rows=3, max_num_tokens=5, block_size=2, num_blocks=24))
    start = threading.Barrier(2, timeout=30)

    def step_loop() -> dict[str, RequestOutput]:
        start.wait()
        ids = {
            llm.add_request(p, sp): (p, sp)
            for c in range(CALLS)
            for p, sp in zip(prompts(5, c), PARAMS, strict=True)
        }
        delivered: dict[str, RequestOutput] = {}
        for _ in range(MAX_STEPS):
            if len(delivered) == len(ids):
                break
            for output in llm.step():
                assert output.request_id not in delivered
                delivered[output.request_id] = output
        assert {i: reference_generate(*ids[i], VOCAB)[0] for i in ids} == {
            i: o.output_ids for i, o in delivered.items()
        }
        return delivered

    def generate_calls() -> list[list[tuple[int, ...]]]:
        start.wait()
        return [[o.output_ids for o in llm.generate(prompts(0, c), PARAMS)] for c in range(CALLS)]

    with ThreadPoolExecutor(2) as pool:
        stepped = pool.submit(step_loop)
        generated = pool.submit(generate_calls)
        assert generated.result() == [want(0, c) for c in range(CALLS)]
        assert len(stepped.result()) == 2 * CALLS
    assert_all_free(llm)
