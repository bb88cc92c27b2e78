"""The FastAPI application: routes, the API key, the body limit and the error objects.

Routes are thin: each validates its body against the protocol models (``protocol``), hands the
work to the endpoint's module (``completions``, ``chat``) which enqueues it with the engine loop
and awaits it, and never touches the model. The OpenAPI schema FastAPI publishes at
``/openapi.json`` lists every route, body and error, and is what the fuzzer tests.

Invariants:
- With an API key, every route but ``/health``, ``/metrics`` and the schema's needs
  ``Authorization: Bearer KEY`` (401 otherwise, compared in constant time), checked before any
  of the body is read: only a client with the key can make the server parse or tokenize
  anything. (vLLM leaves ``/tokenize`` and ``/detokenize`` open; here they encode and decode
  up to a body's worth of text, so they are guarded as the routes that generate.)
- A request body over ``max_body_bytes`` is refused with 413 before the app reads it (by its
  ``Content-Length``, or while it arrives); a client gone before its body ended gets nothing
  (no route runs); nothing a client sends reaches a path or a shell.
- ``/health`` answers 200 while the engine can serve and 503 with the reason once it failed.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runners.serve.chat import create_chat_completion
from runners.serve.completions import create_completion
from runners.serve.context import ServerContext
from runners.serve.errors import ApiError, error_response, install_error_handlers
from runners.serve.metrics import CONTENT_TYPE
from runners.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from runners.serve.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

__all__ = ["build_app"]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "a field is malformed, out of range or not supported (param names it)"),
        (404, "unknown model"),
        (408, "the request did not arrive whole within the server's request timeout"),
        (413, "request body too large"),
        (500, "the server's own failure"),
        (503, "the server is full (Retry-After) or the engine failed"),
    )
}
_AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
}
_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or events if stream"},
    **_AUTH_ERRORS,
}


def build_app(context: ServerContext) -> FastAPI:
    """The server's application over ``context`` (module docstring)."""
    settings = context.settings
    app = FastAPI(title="dsv4 serve", version="1", summary="OpenAI-compatible DeepSeek-V4 server")
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(_KeyCheck, key=settings.api_key)  # outermost: before the body

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> dict[str, str]:
        if context.loop.failure is not None:
            raise ApiError(503, context.loop.failure)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_AUTH_ERRORS)
    async def models() -> ModelList:
        card = ModelCard(
            id=settings.model_name, created=settings.created, max_model_len=settings.max_model_len
        )
        return ModelList(data=[card])

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=_STREAMED,
    )
    async def completions(
        body: CompletionRequest, request: Request
    ) -> CompletionResponse | StreamingResponse:
        return await create_completion(context, body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=_STREAMED,
    )
    async def chat(
        body: ChatCompletionRequest, request: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        return await create_chat_completion(context, body, request)

    @app.post("/tokenize", responses=_AUTH_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        context.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text} for m in body.messages]
            tokens = await context.encode_chat(messages)
        else:
            assert body.prompt is not None
            tokens = await context.encode(body.prompt, "prompt")
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=settings.max_model_len
        )

    @app.post("/detokenize", responses=_AUTH_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        context.check_model(body.model)
        context.check_ids(body.tokens, "tokens")
        context.require_tokenizer("tokens")
        return DetokenizeResponse(prompt=await context.decode_off_loop(body.tokens))

    return app


OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/redoc"})
"""The routes that need no key (the module docstring)."""


class _KeyCheck:
    """Refuse (401) a request to a guarded route without the key, before reading its body."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                refusal = ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Refuse (413) a request whose body is over ``limit`` bytes, before the app reads any."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ApiError(413, f"the request body is larger than {self.limit} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await error_response(too_large)(scope, receive, send)
            return
        body: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left (or timed out) mid-body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await error_response(too_large)(scope, receive, send)
                return
            body.append(chunk)
            if not message.get("more_body", False):
                break
        first: Message = {"type": "http.request", "body": b"".join(body), "more_body": False}
        await self.app(scope, _replay(first, receive), send)


def _replay(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that gives ``first`` (the whole body), then the connection's messages."""
    queued = [first]

    async def replayed() -> Message:
        if queued:
            return queued.pop()
        return await receive()

    return replayed
