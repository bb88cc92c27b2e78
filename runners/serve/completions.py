"""``POST /v1/completions``: prompts as text or token ids, completed by the engine, answered
whole or streamed.

Invariants:
- Each prompt (text, token ids, or a list of either) is one engine request per choice; their
  text is the engine's (``RequestOutput.text``), cut before a stop string, and the streamed
  pieces of a choice concatenate to exactly the text the same request answers unstreamed.
- ``usage`` counts each prompt's tokens once and every generated token (``completion_tokens``),
  whatever the text shows.
- ``echo`` prefixes each choice's text with its prompt's text (decoded, for token ids).
- Everything that does not need the prompts' tokens (the model, the count of choices, the
  sampling fields) is checked before any prompt is encoded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from runners.engine import FinishReason, RequestOutput, TokenLogprob
from runners.serve.context import ServerContext
from runners.serve.engine_loop import EngineDeadError
from runners.serve.errors import ApiError, unsupported
from runners.serve.generation import Generation, new_id, raise_if_failed, sampling_params
from runners.serve.protocol import CompletionRequest
from runners.serve.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from runners.serve.sse import DONE, error_event, event, streaming_response, until_gone

__all__ = ["DEFAULT_MAX_TOKENS", "create_completion"]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""


Prompt = str | list[int] | list[str] | list[list[int]]


def _items(prompt: Prompt) -> list[Any]:
    """The prompts of ``prompt``: itself for one (a text or token ids), else its items."""
    single = isinstance(prompt, str) or isinstance(prompt[0], int)
    return [prompt] if single else list(prompt)


async def _prompts(
    context: ServerContext, items: list[Any], max_tokens: int, echo: bool
) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, checked against the model, and (for ``echo``) its text."""
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            prompt = await context.encode(item, "prompt")
            context.check_length(prompt, max_tokens, "prompt")
        else:
            prompt = item
            context.check_length(prompt, max_tokens, "prompt")  # before reading each id
            context.check_ids(prompt, "prompt")
        ids.append(prompt)
        if echo:
            texts.append(item if isinstance(item, str) else await context.decode_off_loop(item))
    return ids, texts


async def create_completion(
    context: ServerContext, body: CompletionRequest, request: Request
) -> CompletionResponse | StreamingResponse:
    context.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise unsupported("echo", "echo with logprobs (the prompt's logprobs) is not supported")
    items = _items(body.prompt)
    context.check_choices(len(items), body.n)
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    context.check_ids(body.stop_token_ids or (), "stop_token_ids")
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)
    prompts, texts = await _prompts(context, items, max_tokens, body.echo)  # all else is valid
    generation = Generation(context, prompts, params)
    await generation.start()
    reply = _Reply(context, body, texts, sum(map(len, prompts)))
    if body.stream:
        return streaming_response(reply.stream(generation), generation)
    try:
        outputs = await until_gone(request, generation.outputs())
    finally:
        generation.close()
    if outputs is None:  # the client left; nobody reads this
        raise ApiError(499, "the client closed the connection")
    return reply.whole(outputs)


class _Reply:
    """The response objects of one completion request."""

    def __init__(
        self,
        context: ServerContext,
        body: CompletionRequest,
        prompt_texts: Sequence[str],
        prompt_tokens: int,
    ) -> None:
        self.context = context
        self.body = body
        self.prompt_texts = prompt_texts
        self.prompt_tokens = prompt_tokens
        self.id = new_id("cmpl")
        self.created = int(time.time())

    def _echo(self, index: int) -> str:
        return self.prompt_texts[index // self.body.n] if self.body.echo else ""

    def whole(self, outputs: Sequence[RequestOutput]) -> CompletionResponse:
        raise_if_failed(outputs)
        choices = [
            CompletionChoice(
                index=i,
                text=self._echo(i) + (o.text or ""),
                logprobs=self._logprobs(o.logprobs or (), len(self._echo(i))),
                finish_reason=o.finish_reason.value,
            )
            for i, o in enumerate(outputs)
        ]
        generated = sum(len(o.output_ids) for o in outputs)
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.context.settings.model_name,
            choices=choices,
            usage=Usage.of(self.prompt_tokens, generated),
        )

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        generated = 0
        offsets = [len(self._echo(i)) for i in range(generation.num_choices)]
        started: set[int] = set()
        try:
            async for index, update in generation.updates():
                generated += len(update.token_ids)
                output = update.finished
                if output is not None and output.finish_reason is FinishReason.ERROR:
                    yield error_event(output.error or "the request failed")
                    yield DONE
                    return
                text = update.text
                if index not in started:
                    started.add(index)
                    text = self._echo(index) + text
                logprobs = self._logprobs(update.logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens) if logprobs else 0
                if not text and logprobs is None and output is None:
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=None if output is None else output.finish_reason.value,
                )
                yield event(self._chunk([choice]))
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield event(self._chunk([], usage=Usage.of(self.prompt_tokens, generated)))
        except EngineDeadError as exc:
            yield error_event(str(exc), status=503)
        finally:
            generation.close()
        yield DONE

    def _chunk(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.context.settings.model_name,
            choices=choices,
            usage=usage,
        )

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs | None:
        if self.body.logprobs is None or not entries:
            return None
        result = CompletionLogprobs()
        for entry in entries:
            token = self.context.token_text(entry.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            top = {self.context.token_text(t): lp for t, lp in entry.top}
            result.top_logprobs.append(top or None)
            result.text_offset.append(offset)
            offset += len(token)
        return result
