"""A deterministic reference executor and a direct generation loop to compare the engine with.

``ReferenceExecutor`` behaves like a model over a paged cache, but its "model" is a fixed function
of a request's whole token history: the logits after position ``p`` are ``history_logits`` of the
tokens at positions ``0 .. p``. It reconstructs that history only from what the engine passes in:
it writes each fed token into its own flat cache at the slot the chunk's blocks give, and reads the
history back through the same blocks. So a wrong position, a wrong or shared block, a block freed
while still in use, a skipped or duplicated token all change the logits, and with them the tokens;
the engine's output then differs from ``reference_generate``, which calls ``history_logits`` on the
true history. With a ``prefix_boundary``, a request may start from a prefix-cache hit: its
history before the hit is then read from blocks other requests wrote, and any wrong one (another
prefix's, a block rewritten since, or one never written) shows the same way. It also checks
every rule of the ``StepExecutor`` contract on every call, and can fail on demand: a whole
call (``fail_next``) or the logits of chosen requests (``poisoned``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from runners.engine import EngineLimits, FinishReason, SamplingParams, ScheduledChunk
from runners.engine.sampling import sample, seeded_generator

_MASK = (1 << 63) - 1


def history_logits(history: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Float32 logits ``[vocab]``: a pseudo-random function of the exact token history."""
    generator = torch.Generator().manual_seed(hash(tuple(history)) & _MASK)
    return torch.randn(vocab_size, generator=generator) * 3.0


class ContractViolation(AssertionError):
    """The engine sent the executor something the ``StepExecutor`` contract forbids."""


class ReferenceExecutor:
    """A ``StepExecutor`` over a flat cache of token ids (see the module docstring)."""

    def __init__(
        self,
        *,
        max_rows: int = 4,
        max_num_tokens: int = 16,
        num_blocks: int = 32,
        block_size: int = 4,
        max_blocks_per_row: int = 8,
        vocab_size: int = 16,
        prefix_boundary: int | None = None,
    ) -> None:
        self.limits = EngineLimits(
            max_rows=max_rows,
            max_num_tokens=max_num_tokens,
            num_blocks=num_blocks,
            block_size=block_size,
            max_blocks_per_row=max_blocks_per_row,
            vocab_size=vocab_size,
            prefix_boundary=prefix_boundary,
        )
        self.cache: list[int | None] = [None] * (num_blocks * block_size)
        self.rows: dict[int, tuple[tuple[int, ...], int]] = {}
        """Per row: the blocks and the number of positions fed so far by its current request."""
        self.steps: list[list[ScheduledChunk]] = []
        self.fail_next: Exception | None = None
        """If set, the next call writes its tokens, then raises this (a mid-step failure)."""
        self.poisoned: Callable[[list[int]], bool] = lambda history: False
        """Rows whose token history this accepts get NaN logits (a model gone bad for them)."""

    def _slot(self, chunk: ScheduledChunk, position: int) -> int:
        size = self.limits.block_size
        return chunk.block_ids[position // size] * size + position % size

    def _check(self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]) -> None:
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise ContractViolation(what)

        limits = self.limits
        require(1 <= len(chunks) <= limits.max_rows, f"{len(chunks)} chunks")
        require(len(token_ids) == len(chunks), "one token list per chunk")
        rows = [c.row for c in chunks]
        require(len(set(rows)) == len(rows), f"rows repeat in one step: {rows}")
        require(sum(c.num_tokens for c in chunks) <= limits.max_num_tokens, "over max_num_tokens")
        held: list[tuple[set[int], set[int]]] = []  # per chunk: blocks it reads, and writes
        for chunk, ids in zip(chunks, token_ids, strict=True):
            require(0 <= chunk.row < limits.max_rows, f"row {chunk.row}")
            require(len(ids) == chunk.num_tokens, "token count differs from num_tokens")
            require(all(0 <= t < limits.vocab_size for t in ids), f"token ids {ids}")
            blocks = chunk.block_ids
            require(len(blocks) <= limits.max_blocks_per_row, "more blocks than a row holds")
            require(len(set(blocks)) == len(blocks), f"a block repeats in row {chunk.row}")
            require(all(0 <= b < limits.num_blocks for b in blocks), f"block ids {blocks}")
            end = chunk.start_position + chunk.num_tokens
            require(end <= len(blocks) * limits.block_size, "blocks do not cover the chunk")
            held.append((set(blocks), set(blocks[chunk.start_position // limits.block_size :])))
            previous = self.rows.get(chunk.row)
            continues = (
                previous is not None
                and blocks[: len(previous[0])] == previous[0]
                and chunk.start_position <= previous[1]
            )
            if chunk.start_position > 0 and not continues:
                # only a new sequence starting where a prefix-cache hit ends may do this
                boundary = limits.prefix_boundary
                require(boundary is not None, f"row {chunk.row} resumes with no history")
                assert boundary is not None
                require(chunk.start_position % boundary == 0, "a hit ends off a boundary")
        for i, (reads, writes) in enumerate(held):
            for other_reads, _ in held[:i] + held[i + 1 :]:
                if limits.prefix_boundary is None:
                    require(not reads & other_reads, f"rows share blocks {reads & other_reads}")
                shared = writes & other_reads
                require(not shared, f"a chunk writes blocks another chunk reads: {shared}")

    def execute(
        self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        self._check(chunks, token_ids)
        self.steps.append(list(chunks))
        for chunk, ids in zip(chunks, token_ids, strict=True):
            for offset, token in enumerate(ids):
                self.cache[self._slot(chunk, chunk.start_position + offset)] = token
            end = chunk.start_position + chunk.num_tokens
            self.rows[chunk.row] = (chunk.block_ids, end)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        vocab_size = self.limits.vocab_size
        logits = torch.empty(len(chunks), vocab_size)
        for i, chunk in enumerate(chunks):
            end = chunk.start_position + chunk.num_tokens
            history = [self.cache[self._slot(chunk, p)] for p in range(end)]
            if any(t is None for t in history):
                raise ContractViolation(f"row {chunk.row} reads a position never written")
            tokens = [t for t in history if t is not None]
            logits[i] = (
                float("nan") if self.poisoned(tokens) else history_logits(tokens, vocab_size)
            )
        return logits


def reference_generate(
    prompt: Sequence[int], params: SamplingParams, vocab_size: int
) -> tuple[tuple[int, ...], FinishReason]:
    """Generate for one prompt alone, recomputing the logits from the whole history each token."""
    history = list(prompt)
    generator = None
    if params.seed is not None and not params.greedy:
        generator = seeded_generator(params.seed, torch.device("cpu"))
    output: list[int] = []
    while True:
        logits = history_logits(history, vocab_size)[None]
        token = sample(logits, [params], [generator])[0]
        output.append(token)
        history.append(token)
        if token in params.stop_ids():
            return tuple(output), FinishReason.STOP
        if len(output) >= params.max_tokens:
            return tuple(output), FinishReason.LENGTH
