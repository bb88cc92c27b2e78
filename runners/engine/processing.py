"""What happens to a step's logits around sampling: penalties and minimum-length masks before,
log-probabilities after.

Invariants:
- Batched and row-wise: each operation runs once per step on the rows that need it (no Python
  loop over the vocabulary), and a row's result depends only on its own logits and its own
  request's tokens, never on which other requests share the step.
- Token counts for the penalties live in one ``[max_rows, vocab]`` table, row ``r`` holding the
  counts of the request in block-table row ``r``. A row is rebuilt from the request's token ids
  whenever it does not hold exactly that request's tokens (a new request in the row, a request
  resumed after preemption, a step that failed), and is updated in place by each sampled token.
  So the counts are always those of the request's ``token_ids``, and cost O(1) per token.
- Requests that ask for none of this cost nothing: the logits pass through unchanged and no
  table is allocated.
- Log-probabilities are taken from the logits the executor returned (vLLM's ``raw_logprobs``):
  the model's distribution, before penalties, masks and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runners.engine.request import Request, TokenLogprob

__all__ = ["LogitsProcessing", "record_logprobs"]


class LogitsProcessing:
    """Penalty counts of the requests in the engine's rows, and the per-step processing."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self._counts: torch.Tensor | None = None
        """``[max_rows, vocab]`` float32: occurrences of each token in the row's output."""
        self._seen: torch.Tensor | None = None
        """``[max_rows, vocab]`` bool: the token occurs in the row's prompt or output."""
        self._owner: list[tuple[Request | None, int]] = [(None, 0)] * max_rows
        """Per row: the request whose counts it holds and how many of its tokens they cover."""

    def process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The logits to sample row ``i`` of ``requests`` from (``logits`` itself when no
        request is penalized or masked)."""
        penalized = [i for i, r in enumerate(requests) if r.params.penalized]
        masked = [
            i for i, r in enumerate(requests) if r.num_output < r.params.min_tokens and r.stop_ids
        ]
        if not penalized and not masked:
            return logits
        logits = logits.clone()
        if penalized:
            self._penalize(logits, [requests[i] for i in penalized], penalized)
        if masked:
            rows = [i for i in masked for _ in requests[i].stop_ids]
            ids = [t for i in masked for t in sorted(requests[i].stop_ids)]
            device = logits.device
            index = (_ids(rows, device), _ids(ids, device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=device))
        return logits

    def record(self, requests: Sequence[Request]) -> None:
        """Count the token each penalized request of ``requests`` just took (call after the
        tokens were committed; finished requests have left their rows and are skipped)."""
        if self._counts is None or self._seen is None:
            return
        rows, tokens = [], []
        for request in requests:
            row = request.row
            if row is None or not request.params.penalized:
                continue
            owner, length = self._owner[row]
            if owner is request and length == len(request.token_ids) - 1:
                rows.append(row)
                tokens.append(request.token_ids[-1])
                self._owner[row] = (request, length + 1)
        if rows:
            device = self._counts.device
            index = (_ids(rows, device), _ids(tokens, device))
            self._counts.index_put_(index, torch.ones(len(rows), device=device), accumulate=True)
            self._seen.index_put_(index, torch.tensor(True, device=device))

    def _penalize(
        self, logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int]
    ) -> None:
        device = logits.device
        if self._counts is None or self._counts.device != device:
            self._counts = torch.zeros(self.max_rows, self.vocab_size, device=device)
            self._seen = torch.zeros(
                self.max_rows, self.vocab_size, dtype=torch.bool, device=device
            )
            self._owner = [(None, 0)] * self.max_rows
        assert self._seen is not None
        for request in requests:
            self._own(request)
        rows = _ids([r.row for r in requests], device)
        where = _ids(positions, device)
        counts, seen, x = self._counts[rows], self._seen[rows], logits[where]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

        repetition = column([r.params.repetition_penalty for r in requests])
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - column([r.params.frequency_penalty for r in requests]) * counts
        x = x - column([r.params.presence_penalty for r in requests]) * (counts > 0)
        logits[where] = x

    def _own(self, request: Request) -> None:
        """Make ``request``'s row hold exactly its counts (module docstring)."""
        assert request.row is not None and self._counts is not None and self._seen is not None
        row = request.row
        if self._owner[row] == (request, len(request.token_ids)):
            return
        device = self._counts.device
        output = _ids(request.token_ids[request.prompt_len :], device)
        self._counts[row].zero_()
        self._counts[row].index_put_(
            (output,), torch.ones(len(output), device=device), accumulate=True
        )
        self._seen[row].zero_()
        self._seen[row, _ids(request.token_ids, device)] = True
        self._owner[row] = (request, len(request.token_ids))


def record_logprobs(
    raw: torch.Tensor, requests: Sequence[Request], tokens: Sequence[object]
) -> None:
    """Append to each request that asks for log-probabilities its sampled token's, from the
    executor's logits ``raw`` (row ``i`` is ``requests[i]``'s; ``tokens[i]`` an int, or the
    reason the row failed, which then gets none)."""
    rows = [
        i for i, r in enumerate(requests) if r.logprobs is not None and isinstance(tokens[i], int)
    ]
    if not rows:
        return
    device = raw.device
    chosen = _ids([tokens[i] for i in rows], device)
    logprobs = raw[_ids(rows, device)].float().log_softmax(dim=-1)
    own: list[float] = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    width = max(requests[i].params.logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if width > 0:
        values, ids = logprobs.topk(width, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        request = requests[i]
        k = request.params.logprobs or 0
        assert request.logprobs is not None
        request.logprobs.append(
            TokenLogprob(
                token_id=int(tokens[i]),  # type: ignore[call-overload]
                logprob=own[j],
                top=tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True)),
            )
        )


def _ids(values: Sequence[object], device: torch.device) -> torch.Tensor:
    """Indices as an int64 tensor (also when empty)."""
    return torch.tensor(values, dtype=torch.int64, device=device)
