"""How far a checkpoint load is: counts for callers, and a progress bar for terminals.

``load_checkpoint(progress=...)`` reports a ``LoadProgress`` once before the first tensor is read,
after each stored tensor is consumed (a quantized weight and its scale are two), and once more
with ``finished=True`` when the load ends, loaded or failed. Totals are the tensors the load reads
(skipped ``mtp.*`` tensors and a tied head are not counted) and their stored bytes.

``TerminalBar`` draws them with ``tqdm`` on a stream (stderr by default): one line of the stored
bytes read, with the tensor count beside them, rewritten in place and ended with a newline on
``finished`` (also when the load fails); on a stream that is not a terminal it writes nothing at
all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, TextIO

import attrs
from tqdm import tqdm

__all__ = ["LoadProgress", "LoadTally", "ProgressOption", "TerminalBar"]


@attrs.frozen(kw_only=True)
class LoadProgress:
    """Tensors and stored bytes consumed so far, out of the load's totals."""

    tensors: int
    total_tensors: int
    bytes: int
    total_bytes: int
    finished: bool = False

    @property
    def fraction(self) -> float:
        """Share of the stored bytes consumed (1.0 for a load with none)."""
        return self.bytes / self.total_bytes if self.total_bytes else 1.0


ProgressOption = Callable[[LoadProgress], None] | Literal["terminal"] | None
"""``load_checkpoint(progress=...)``: ``"terminal"`` (a ``TerminalBar`` on stderr), ``None``
(no reports) or a callable receiving every report."""


class TerminalBar:
    """Draws ``LoadProgress`` reports on ``stream`` when it is a terminal (see the module)."""

    def __init__(self, stream: TextIO | None = None, label: str = "loading checkpoint") -> None:
        self.stream = sys.stderr if stream is None else stream
        self.label = label
        self.enabled = self.stream.isatty()
        self._bar: tqdm[Any] | None = None

    def __call__(self, progress: LoadProgress) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = tqdm(
                desc=self.label,
                total=progress.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                leave=True,
                dynamic_ncols=True,
            )
        bar = self._bar
        bar.set_postfix_str(f"{progress.tensors}/{progress.total_tensors} tensors", refresh=False)
        bar.update(progress.bytes - bar.n)
        if progress.finished:
            bar.refresh()
            bar.close()
            self._bar = None


class LoadTally:
    """Counts the consumed tensors of a load (``sizes``: each one's stored bytes) and reports
    each step where ``option`` says (the first report, all zero, when built)."""

    def __init__(self, sizes: Mapping[Hashable, int], option: ProgressOption) -> None:
        self._sizes = sizes
        self._total = sum(sizes.values())
        self._sink = TerminalBar() if isinstance(option, str) else option
        self._tensors = 0
        self._bytes = 0
        self._report(finished=False)

    def done(self, item: Hashable) -> None:
        """``item`` (one of ``sizes``) was consumed."""
        self._tensors += 1
        self._bytes += self._sizes[item]
        self._report(finished=False)

    def finish(self) -> None:
        """The load ended (loaded or failed): the last report."""
        self._report(finished=True)

    def _report(self, *, finished: bool) -> None:
        if self._sink is not None:
            self._sink(
                LoadProgress(
                    tensors=self._tensors,
                    total_tensors=len(self._sizes),
                    bytes=self._bytes,
                    total_bytes=self._total,
                    finished=finished,
                )
            )
