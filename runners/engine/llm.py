"""The engine: requests in, tokens out, one ``StepExecutor`` call per step.

Two ways to drive it:
- ``generate(prompts, params)``: run a batch to completion and return outputs in prompt order;
- ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``: the step-level API a server loop or
  a hypothesis state machine drives; ``step`` returns the requests that finished in it.

Invariants:
- Every input error is raised before the engine changes, as an ``EngineError`` subclass with a
  one-line message; running requests are untouched by a refused one.
- A step that raises is all-or-nothing: if the executor raises or returns malformed logits, no
  request advances and the next ``step`` feeds the same positions again, so the engine stays
  usable.
- A request whose next token cannot be sampled (NaN or inf logits) fails alone: it finishes with
  ``FinishReason.ERROR`` and an ``error`` naming it and the reason, its blocks and row are freed
  in that step, and the other requests advance exactly as without it. ``step`` returns it like
  any finished request; ``generate`` lets the rest of its call finish, then raises
  ``RequestFailedError`` carrying every output of the call.
- Running out of KV blocks is not an error: requests are admitted by the blocks their next step
  needs, and when the blocks run out the newest running request is preempted and later
  recomputed (see ``scheduler``). Its output is the one it would have had without preemption.
- With prefix caching (the default, where the executor allows it), a request admitted starts
  from the longest prefix of its tokens another request computed (``prefix_cache``); its output
  is the one it would have had without the cache.
- One re-entrant lock serialises the public methods (see ``LLM``), so one engine may be shared
  by threads.
- Host work per step is proportional to the number of chunks, not to the tokens fed (prefill
  chunks are slices of the request's token list) nor to the vocabulary (one argmax for all
  greedy rows; penalties, masks and log-probabilities are batched: ``processing``), nor to the
  length of the output (text is decoded incrementally: ``text``).
- Stopping: a request stops at its ``stop_token_ids``, at the engine's ``eos_token_ids`` (the
  checkpoint's EOS ids for an engine ``build_engine`` builds) unless it sets ``ignore_eos``, and
  at its stop strings, matched in the text the engine's ``detokenize`` gives.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from runners.engine.errors import EngineConfigError, ExecutorError, InvalidRequestError
from runners.engine.executor import StepExecutor
from runners.engine.params import SamplingParams
from runners.engine.processing import LogitsProcessing, record_logprobs
from runners.engine.request import (
    FinishReason,
    Listener,
    Request,
    RequestFailedError,
    RequestOutput,
)
from runners.engine.sampling import sample, seeded_generator
from runners.engine.scheduler import Scheduler
from runners.engine.stats import EngineStats, GenerateProgress
from runners.engine.text import Detokenize
from runners.engine.validation import check_fits, check_params, check_prompt

__all__ = ["LLM", "EngineStats", "GenerateProgress"]


class LLM:
    """Continuous-batching engine over a ``StepExecutor`` (see the module docstring).

    Threads: every public method holds one re-entrant lock for its whole call, so calls from
    several threads are serialised and each returns what it would have returned alone; a
    ``generate`` runs to completion (its ``progress`` callback included) before another thread's
    call starts. To batch work from several threads together, submit it with ``add_request`` and
    let one thread drive ``step``.
    """

    def __init__(
        self,
        executor: StepExecutor,
        *,
        max_num_batched_tokens: int | None = None,
        eos_token_ids: Sequence[int] = (),
        detokenize: Detokenize | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        """``max_num_batched_tokens``: the token budget of one step (default and upper bound:
        the executor's ``limits.max_num_tokens``); ``eos_token_ids``: the ids that end every
        request not ignoring EOS; ``detokenize``: token ids to text, for ``RequestOutput.text``
        and stop strings (without it, a request with stop strings is refused);
        ``enable_prefix_caching``: share the blocks of equal prompt prefixes between requests
        (``prefix_cache``), where the executor allows it (``limits.prefix_boundary``)."""
        self.executor = executor
        limits = executor.limits
        budget = limits.max_num_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        if not 1 <= budget <= limits.max_num_tokens:
            raise EngineConfigError(
                f"max_num_batched_tokens must be in [1, {limits.max_num_tokens}] "
                f"(the executor's max_num_tokens), got {budget}"
            )
        self.vocab_size = limits.vocab_size
        bad = [i for i in eos_token_ids if not 0 <= i < limits.vocab_size]
        if bad:
            raise EngineConfigError(
                f"eos token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})"
            )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.block_size = limits.block_size
        self.max_context = limits.max_context
        self.scheduler = Scheduler(
            max_rows=limits.max_rows,
            num_blocks=limits.num_blocks,
            block_size=limits.block_size,
            token_budget=budget,
            num_entry_blocks=limits.num_entry_blocks,
            entry_rate=limits.entry_rate,
            lookback=limits.lookback,
            prefix_boundary=limits.prefix_boundary if enable_prefix_caching else None,
        )
        self._processing = LogitsProcessing(limits.max_rows, limits.vocab_size)
        self._ids = itertools.count()
        self._undelivered: list[RequestOutput] = []
        self._generated_tokens = 0
        self._lock = threading.RLock()

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        listener: Listener | None = None,
    ) -> str:
        """Queue a request and return its id; raise ``InvalidRequestError`` (or its subclass
        ``RequestTooLongError``) without changing anything if it is malformed or can never fit.

        One choice per request: ``params.n`` must be 1 (add ``params.choice(i)`` for each
        choice). ``listener`` is handed a ``RequestUpdate`` after each step that sampled a
        token for the request, the last one carrying its output (not after ``abort``)."""
        with self._lock:
            if params is not None and isinstance(params, SamplingParams) and params.n != 1:
                raise InvalidRequestError(
                    f"add_request takes one choice, got n = {params.n}: add params.choice(i) "
                    "for each choice (generate does)"
                )
            request = self._prepare(prompt_ids, params, request_id, listener)
            self.scheduler.add(request)
            return request.request_id

    def check(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> None:
        """Raise what ``add_request`` would raise for this prompt, changing nothing (so a caller
        can refuse bad input before expensive work such as graph capture)."""
        with self._lock:
            self._prepare(prompt_ids, params, request_id="", listener=None)

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it (and any finished during a
        ``generate`` call that belonged to step-level callers), failed ones included."""
        with self._lock:
            finished = self._undelivered + self._step()
            self._undelivered = []
            return finished

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a live request now and free its blocks; return what it produced so far
        (``FinishReason.ABORT``), or None if no live request has this id."""
        with self._lock:
            return self.scheduler.abort(request_id)

    def generated(self, request_id: str) -> tuple[int, ...]:
        """The tokens a live request has generated so far (empty for an unknown or finished
        one: its ``RequestOutput`` holds them); for streaming them as they come."""
        with self._lock:
            request = self.scheduler.live.get(request_id)
            if request is None:
                return ()
            return tuple(request.token_ids[request.prompt_len :])

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.scheduler.live) or bool(self._undelivered)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            return EngineStats(
                waiting=len(s.waiting),
                running=len(s.running),
                free_blocks=s.blocks.num_free,
                total_blocks=s.blocks.size,
                free_rows=s.rows.num_free,
                total_rows=s.rows.size,
                free_entry_blocks=s.entry_blocks.num_free,
                total_entry_blocks=s.entry_blocks.size,
                released_blocks=s.num_released_blocks,
                preemptions=s.num_preemptions,
                prefix_cache=None if s.prefix_cache is None else s.prefix_cache.stats(),
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[GenerateProgress], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order (a prompt whose params have
        ``n > 1`` gives its ``n`` choices one after another). All prompts are validated before
        any is queued; on any exception (including KeyboardInterrupt) this call's requests are
        aborted, so the engine is left as it was found. If requests fail (their logits could not
        be sampled), the others still finish, then ``RequestFailedError`` is raised with every
        output of the call."""
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts"
                )
        with self._lock:
            requests = [
                self._prepare(prompt, choice, None, None)
                for prompt, sp in zip(prompts, per_prompt, strict=True)
                for choice in _choices(sp)
            ]
            mine = {r.request_id: i for i, r in enumerate(requests)}
            for request in requests:
                self.scheduler.add(request)
            results: list[RequestOutput | None] = [None] * len(requests)
            done = 0
            start_tokens = self._generated_tokens
            try:
                while done < len(requests):
                    for output in self._step():
                        index = mine.get(output.request_id)
                        if index is None:
                            self._undelivered.append(output)
                        else:
                            results[index] = output
                            done += 1
                    if progress is not None:
                        progress(
                            GenerateProgress(
                                finished=done,
                                total=len(requests),
                                generated_tokens=self._generated_tokens - start_tokens,
                            )
                        )
            except BaseException:
                for request_id, index in mine.items():
                    if results[index] is None:
                        self.scheduler.abort(request_id)
                raise
        outputs = [r for r in results if r is not None]
        if any(o.finish_reason is FinishReason.ERROR for o in outputs):
            raise RequestFailedError(outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        logits = self.executor.execute(step.chunks, step.token_ids)
        expected = (len(step.chunks), self.vocab_size)
        if tuple(logits.shape) != expected or not logits.is_floating_point():
            raise ExecutorError(
                f"executor returned logits of shape {tuple(logits.shape)} and dtype "
                f"{logits.dtype}; expected float32 {expected}"
            )
        rows = step.sample_rows
        if len(rows) < len(step.chunks):
            logits = logits[rows]
        requests = [step.requests[i] for i in rows]
        for request in requests:
            if request.generator is None and request.params.seed is not None:
                request.generator = seeded_generator(request.params.seed, logits.device)
        processed = self._processing.process(logits, requests)
        tokens = sample(
            processed,
            [r.params for r in requests],
            [r.generator for r in requests],
            finite=None if processed is logits else torch.isfinite(logits).all(dim=-1),
        )
        record_logprobs(logits, requests, tokens)
        self._generated_tokens += sum(isinstance(t, int) for t in tokens)
        finished = self.scheduler.commit(step, tokens)
        self._processing.record(requests)
        outputs = {output.request_id: output for output in finished}
        for request in requests:
            if request.listener is not None:
                request.listener(request.update(outputs.get(request.request_id)))
        return finished

    def _prepare(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        listener: Listener | None,
    ) -> Request:
        params = check_params(params, self.vocab_size, self.detokenize is not None)
        prompt = check_prompt(prompt_ids, self.vocab_size)
        check_fits(prompt, params, self.scheduler, self.max_context)
        if request_id is None:
            request_id = self._fresh_id()
        elif not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a str, got {request_id!r}")
        elif request_id in self.scheduler.live:
            raise InvalidRequestError(f"request id {request_id!r} is already live")
        return Request(
            request_id,
            prompt,
            params,
            eos_token_ids=self.eos_token_ids,
            detokenize=self.detokenize,
            listener=listener,
        )

    def _fresh_id(self) -> str:
        while True:
            candidate = str(next(self._ids))
            if candidate not in self.scheduler.live:
                return candidate


def _choices(params: SamplingParams | None) -> list[SamplingParams | None]:
    """The parameters of each choice of one prompt (``SamplingParams.choice``)."""
    if not isinstance(params, SamplingParams) or params.n == 1:
        return [params]
    return [params.choice(i) for i in range(params.n)]
