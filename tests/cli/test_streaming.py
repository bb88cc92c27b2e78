"""Streaming ``dsv4 run``'s text: only stable text is printed, requests one after another, and
the step-level generation returns what ``LLM.generate`` returns."""

from __future__ import annotations

import io

import pytest

from runners.cli.prompts import byte_level_text
from runners.cli.streaming import StreamPrinter, TextStream, generate_streaming
from runners.engine import SamplingParams
from runners.spec import Engine, EngineSpec, build_engine


def test_a_partial_utf8_character_is_held_back() -> None:
    stream = TextStream(byte_level_text)
    snow = list("☃".encode())
    assert stream.push([104]) == "h"
    assert stream.push([104, snow[0]]) == ""
    assert stream.push([104, *snow[:2]]) == ""
    assert stream.push([104, *snow]) == "☃"
    assert stream.finish([104, *snow, 33]) == "!"
    assert stream.emitted == "h☃!"


def test_a_rewritten_prefix_stops_the_stream_until_it_agrees_again() -> None:
    texts = {1: "ab", 2: "aX", 3: "abc"}
    stream = TextStream(lambda ids: texts[len(ids)])
    assert stream.push([0]) == "ab"
    assert stream.push([0, 0]) == ""
    assert stream.finish([0, 0, 0]) == "c"


def test_requests_are_printed_in_order_never_interleaved() -> None:
    out = io.StringIO()
    printer = StreamPrinter(2, byte_level_text, out)
    printer.update(1, list(b"xy"), False)
    assert out.getvalue() == "[0] "
    printer.update(0, list(b"ab"), False)
    assert out.getvalue() == "[0] ab"
    printer.update(1, list(b"xyz"), True)
    printer.update(0, list(b"abc"), True)
    assert out.getvalue() == "[0] abc\n[1] xyz\n"
    printer.close_line()
    assert out.getvalue().endswith("z\n")


def test_an_interrupted_stream_closes_its_line() -> None:
    out = io.StringIO()
    printer = StreamPrinter(1, byte_level_text, out)
    printer.update(0, list(b"ab"), False)
    printer.close_line()
    assert out.getvalue() == "[0] ab\n"


@pytest.fixture(scope="module")
def engine() -> Engine:
    spec = EngineSpec(platform="cpu", capture_sizes=(1, 2, 4), cudagraph_mode="NONE")
    return build_engine(spec)


def test_streaming_generation_equals_generate(engine: Engine) -> None:
    prompts = [[1, 2, 3, 4, 5], [9, 8], [7]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seen: list[tuple[int, tuple[int, ...], bool]] = []
    streamed = generate_streaming(
        engine.llm, prompts, params, lambda i, ids, done: seen.append((i, tuple(ids), done))
    )
    expected = engine.llm.generate(prompts, params)
    assert [o.output_ids for o in streamed] == [o.output_ids for o in expected]
    assert [o.finish_reason for o in streamed] == [o.finish_reason for o in expected]
    for i, output in enumerate(expected):
        reports = [(ids, done) for j, ids, done in seen if j == i]
        assert reports[-1] == (output.output_ids, True)
        assert all(output.output_ids[: len(ids)] == ids for ids, _ in reports), "prefixes"
        assert [len(ids) for ids, _ in reports] == sorted({len(ids) for ids, _ in reports})
    assert not engine.llm.has_unfinished()


def test_an_exception_in_the_callback_aborts_the_requests(engine: Engine) -> None:
    def explode(index: int, ids: object, done: bool) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_streaming(engine.llm, [[1, 2, 3]], SamplingParams(max_tokens=4), explode)
    assert not engine.llm.has_unfinished()
