"""Printing generated text while it is generated (``dsv4 run`` on a terminal).

Invariants:
- ``TextStream`` hands out only text later tokens cannot change: text ending in U+FFFD (a
  character whose bytes are still arriving) is held back, and if the decoder rewrites text
  already handed out, nothing more is handed out until it agrees again. Everything it hands out
  is, concatenated, a prefix of the final decoding (all of it when the decoder never rewrites).
- ``StreamPrinter`` prints request by request in prompt order, never interleaved: ``[i] `` then
  request ``i``'s text as it grows, then a newline once it has finished; a later request's text
  waits (still being generated, in the same batch) until the earlier ones are printed.
- ``generate_streaming`` returns what ``LLM.generate`` would for the same prompts and params
  (outputs in prompt order; ``RequestFailedError`` after all finished if any failed; on any
  exception its requests are aborted), reporting each request's tokens after every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO

from runners.engine import (
    LLM,
    FinishReason,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
)

__all__ = ["StreamPrinter", "TextStream", "generate_streaming"]

Decode = Callable[[Sequence[int]], str]
OnTokens = Callable[[int, Sequence[int], bool], None]
"""Called with (prompt index, the tokens generated so far, whether the request finished)."""


class TextStream:
    """The text of one growing token sequence, handed out piece by piece (module docstring)."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.emitted = ""

    def push(self, ids: Sequence[int]) -> str:
        """The new stable text, given every token generated so far."""
        return self._advance(self._decode(ids).rstrip("\ufffd"))

    def finish(self, ids: Sequence[int]) -> str:
        """The rest of the text, given the final tokens (nothing is held back any more)."""
        return self._advance(self._decode(ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted):
            return ""
        new = text[len(self.emitted) :]
        self.emitted = text
        return new


class StreamPrinter:
    """Prints the text of several requests to ``out``, one after another (module docstring)."""

    def __init__(self, count: int, decode: Decode, out: TextIO) -> None:
        self._streams = [TextStream(decode) for _ in range(count)]
        self._latest: list[Sequence[int]] = [() for _ in range(count)]
        self._finished = [False] * count
        self._current = 0
        self._line_open = False
        self._out = out

    def update(self, index: int, ids: Sequence[int], finished: bool) -> None:
        """Record request ``index``'s tokens so far and print what can be printed now."""
        self._latest[index] = ids
        self._finished[index] = self._finished[index] or finished
        while self._current < len(self._streams):
            i = self._current
            if not self._line_open:
                self._out.write(f"[{i}] ")
                self._line_open = True
            stream = self._streams[i]
            if not self._finished[i]:
                self._out.write(stream.push(self._latest[i]))
                break
            self._out.write(stream.finish(self._latest[i]) + "\n")
            self._line_open = False
            self._current += 1
        self._out.flush()

    def close_line(self) -> None:
        """End a line left open (an interrupted run), so what follows starts on its own line."""
        if self._line_open:
            self._out.write("\n")
            self._out.flush()
            self._line_open = False


def generate_streaming(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    on_tokens: OnTokens,
) -> list[RequestOutput]:
    """Generate like ``llm.generate(prompts, params)``, calling ``on_tokens`` whenever a request
    has new tokens and once when it finishes (module docstring)."""
    ids: list[str] = []
    results: dict[str, RequestOutput] = {}
    try:
        ids.extend(llm.add_request(prompt, params) for prompt in prompts)
        index = {request_id: i for i, request_id in enumerate(ids)}
        seen = [0] * len(ids)
        while len(results) < len(ids):
            for output in llm.step():
                if output.request_id in index:
                    results[output.request_id] = output
                    on_tokens(index[output.request_id], output.output_ids, True)
            for i, request_id in enumerate(ids):
                if request_id in results:
                    continue
                tokens = llm.generated(request_id)
                if len(tokens) != seen[i]:
                    seen[i] = len(tokens)
                    on_tokens(i, tuple(tokens), False)
    except BaseException:
        for request_id in ids:
            if request_id not in results:
                llm.abort(request_id)
        raise
    outputs = [results[request_id] for request_id in ids]
    if any(o.finish_reason is FinishReason.ERROR for o in outputs):
        raise RequestFailedError(outputs)
    return outputs
