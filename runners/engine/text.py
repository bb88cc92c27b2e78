"""The text of a request's output as it grows, and the stop strings matched in it.

The engine knows no tokenizer: whoever builds it may hand it a ``Detokenize`` function (token ids
to text; ``build_engine`` passes the checkpoint tokenizer's ``decode``), and each request that
wants text gets an ``IncrementalText`` over it.

Invariants:
- Decoding is incremental: each new token decodes a short window (the tokens since the last
  point where the text ended on a whole character, as vLLM's incremental detokenizer does), so
  the work per token does not grow with the output. Text whose last character is still
  incomplete (it decodes to U+FFFD while its bytes arrive) is not taken until it completes, or
  until the request ends (``flush``). For a decoder that is concatenative at character
  boundaries (byte-level vocabularies such as DeepSeek's), ``text`` after ``flush`` equals
  ``decode(output_ids)``.
- A stop string is searched only in text new since the last token (widened by the stop's length
  less one, so a stop split across tokens is found), and only once the output holds more than
  ``min_tokens`` tokens. The earliest match wins; ``text`` is then cut before it (after it with
  ``include_stop``) and never grows again.
- ``stable`` is the length of text that can be handed out now: every completed character except
  a suffix that might still become the start of a stop string. What was handed out is always a
  prefix of the final ``text``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Detokenize", "IncrementalText"]

Detokenize = Callable[[Sequence[int]], str]
"""Token ids to text (special tokens skipped), as a checkpoint tokenizer's ``decode``."""

_INCOMPLETE = "\ufffd"


class IncrementalText:
    """The growing text of one output (see the module docstring)."""

    __slots__ = ("_decode", "_include_stop", "_prefix", "_read", "_stops", "stopped", "text")

    def __init__(self, decode: Detokenize, stops: tuple[str, ...], include_stop: bool) -> None:
        self._decode = decode
        self._stops = stops
        self._include_stop = include_stop
        self._prefix = 0
        """Start of the decoding window, in output tokens."""
        self._read = 0
        """Output tokens whose text is in ``text``."""
        self.text = ""
        self.stopped = False

    def push(self, ids: Sequence[int], start: int, match_stops: bool) -> bool:
        """Take the text of the output ``ids[start:]`` after its newest token; return True if a
        stop string is now matched (``match_stops``: the output is past its ``min_tokens``)."""
        if self.stopped:
            return True
        window = ids[start + self._prefix :]
        new = self._decode(window)
        if new.endswith(_INCOMPLETE):
            return False
        before = self._decode(window[: self._read - self._prefix])
        if len(new) <= len(before):
            return False
        old_length = len(self.text)
        self.text += new[len(before) :]
        self._prefix, self._read = self._read, len(ids) - start
        return match_stops and self._match(old_length)

    def flush(self, ids: Sequence[int], start: int) -> None:
        """Take the rest of the text, incomplete characters included (the request ended)."""
        if self.stopped or len(ids) - start == self._read:
            return
        window = ids[start + self._prefix :]
        before = self._decode(window[: self._read - self._prefix])
        self.text += self._decode(window)[len(before) :]
        self._prefix = self._read = len(ids) - start

    @property
    def stable(self) -> int:
        """Characters of ``text`` that can be handed out now (module docstring)."""
        if self.stopped or not self._stops:
            return len(self.text)
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:size]):
                    held = size
                    break
        return len(self.text) - held

    def _match(self, old_length: int) -> bool:
        """Cut ``text`` at the earliest stop string ending in its new part, if any."""
        found: tuple[int, int] | None = None
        for stop in self._stops:
            at = self.text.find(stop, max(0, old_length - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, len(stop))
        if found is None:
            return False
        at, length = found
        self.text = self.text[: at + length if self._include_stop else at]
        self.stopped = True
        return True
