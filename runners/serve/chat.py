"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template (a 400
without one), completed by the engine, answered whole or streamed.

Invariants:
- The prompt is ``apply_chat_template(messages, add_generation_prompt=True)``'s token ids
  (``CheckpointTokenizer.encode_messages``), so a single user message is exactly what
  ``dsv4 run --chat --prompt`` generates from.
- ``max_completion_tokens`` wins over ``max_tokens``; without either a reply may fill the rest
  of ``max_model_len``.
- Streamed, each choice's first chunk carries ``role``; the content pieces of a choice
  concatenate to the content the same request answers unstreamed; ``finish_reason`` is only on a
  choice's last chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from runners.engine import FinishReason, RequestOutput, TokenLogprob
from runners.serve.context import ServerContext
from runners.serve.engine_loop import EngineDeadError
from runners.serve.errors import ApiError
from runners.serve.generation import Generation, new_id, raise_if_failed, sampling_params
from runners.serve.protocol import ChatCompletionRequest
from runners.serve.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatTopLogprob,
    ResponseMessage,
    Usage,
)
from runners.serve.sse import DONE, error_event, event, streaming_response, until_gone

__all__ = ["create_chat_completion"]


async def create_chat_completion(
    context: ServerContext, body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | StreamingResponse:
    context.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    context.check_choices(1, body.n)
    messages = [{"role": m.role, "content": m.text} for m in body.messages]
    prompt = await context.encode_chat(messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or context.default_max_tokens(prompt)
    context.check_length(prompt, max_tokens, "messages")
    context.check_ids(body.stop_token_ids or (), "stop_token_ids")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)
    generation = Generation(context, [prompt], params)
    await generation.start()
    reply = _Reply(context, body, len(prompt))
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
    """The response objects of one chat request."""

    def __init__(self, context: ServerContext, body: ChatCompletionRequest, prompt: int) -> None:
        self.context = context
        self.body = body
        self.prompt_tokens = prompt
        self.id = new_id("chatcmpl")
        self.created = int(time.time())

    def whole(self, outputs: Sequence[RequestOutput]) -> ChatCompletionResponse:
        raise_if_failed(outputs)
        choices = [
            ChatChoice(
                index=i,
                message=ResponseMessage(content=o.text or ""),
                logprobs=self._logprobs(o.logprobs or ()),
                finish_reason=o.finish_reason.value,
            )
            for i, o in enumerate(outputs)
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.context.settings.model_name,
            choices=choices,
            usage=Usage.of(self.prompt_tokens, sum(len(o.output_ids) for o in outputs)),
        )

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        generated = 0
        try:
            for index in range(generation.num_choices):
                delta = ChatDelta(role="assistant", content="")
                yield event(self._chunk([ChatChunkChoice(index=index, delta=delta)]))
            async for index, update in generation.updates():
                generated += len(update.token_ids)
                output = update.finished
                if output is not None and output.finish_reason is FinishReason.ERROR:
                    yield error_event(output.error or "the request failed")
                    yield DONE
                    return
                logprobs = self._logprobs(update.logprobs)
                if not update.text and logprobs is None and output is None:
                    continue
                choice = ChatChunkChoice(
                    index=index,
                    delta=ChatDelta(content=update.text or None),
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
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.context.settings.model_name,
            choices=choices,
            usage=usage,
        )

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self.body.logprobs or not entries:
            return None
        text = self.context.token_text
        return ChatLogprobs(
            content=[
                ChatLogprob(
                    token=text(entry.token_id),
                    logprob=entry.logprob,
                    top_logprobs=[ChatTopLogprob(token=text(t), logprob=lp) for t, lp in entry.top],
                )
                for entry in entries
            ]
        )
