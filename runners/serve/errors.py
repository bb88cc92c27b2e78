"""Every failure a client can see, as OpenAI's error object: ``{"error": {"message", "type",
"param", "code"}}`` with the HTTP status as ``code``.

Invariants:
- Whatever a client sends that the server refuses is a 4xx naming the field (``param``): schema
  violations (400, from pydantic's first errors), fields the server does not implement (400),
  values the engine refuses (400, ``InvalidRequestError``), unknown models and routes (404), a
  wrong method (405), a missing or wrong key (401), a body over the limit (413), a request
  that did not arrive within the request timeout (408, ``connections``), a full queue (503 with
  ``Retry-After``: only for a request that fits once others finish). Only the server's own
  failures are 5xx, and they too are error objects (never Starlette's plain-text 500).
- ``param`` is the full dotted path of the field (``messages.0.role``, ``stop``); messages are
  one line, valid UTF-8 (a lone surrogate is written as its ``\\u`` escape), and never echo
  more than a short excerpt of what was sent (a path, a model name, a value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from runners.engine import InvalidRequestError
from runners.serve.engine_loop import EngineDeadError
from runners.serve.responses import ErrorInfo, ErrorResponse

__all__ = [
    "ApiError",
    "error_body",
    "error_response",
    "excerpt",
    "install_error_handlers",
    "unsupported",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A refusal to send as an error object (module docstring)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = _printable(" ".join(message.split()))
        self.param = None if param is None else _printable(param)
        self.headers = dict(headers or {})


def _printable(text: str) -> str:
    """``text`` as valid UTF-8: each lone surrogate written as its escape (``\\udfff``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unsupported(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


def error_body(error: ApiError) -> bytes:
    """The JSON bytes of ``error``'s object (for a response written below the app)."""
    return bytes(error_response(error).body)


def error_response(error: ApiError) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(
            message=error.message,
            type=_TYPES.get(error.status, "invalid_request_error"),
            param=error.param,
            code=error.status,
        )
    )
    return JSONResponse(body.model_dump(), status_code=error.status, headers=error.headers)


def _field(location: Sequence[Any]) -> str | None:
    """The request field a pydantic error location names (``body`` and union branches, such
    as ``str`` or ``list[int]``, left out)."""
    parts = [str(p) for p in location[1:] if isinstance(p, int) or p.isidentifier()]
    return ".".join(parts) or None


def excerpt(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming its field."""
    errors = list(exc.errors())
    first = errors[0]
    kind = first.get("type", "")
    location = first.get("loc", ())
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}")
    field = _field(location)
    if kind == "string_unicode":  # a lone surrogate in a value, or (no location) in a key
        got = excerpt(first.get("input"))
        if field is None:
            return ApiError(400, f"the key {got} is not valid Unicode (a lone surrogate)")
        return ApiError(
            400, f"{field}: is not valid Unicode: a lone surrogate in {got}", param=field
        )
    if location in (("body",), ()):
        return ApiError(400, f"the request body must be a JSON object: {first.get('msg', '')}")
    if kind == "extra_forbidden":
        if field is None or not str(location[-1]).isidentifier():  # a key no model has
            return ApiError(400, f"the field {excerpt(location[-1])} is not supported")
        return unsupported(field, "this field is not supported by this server")
    if kind == "missing":
        return ApiError(400, f"{field}: field required", param=field)
    message = f"{field}: {first.get('msg', 'invalid value')}"
    if "input" in first and kind not in ("missing",):
        message += f" (got {excerpt(first['input'])})"
    more = len({_field(e.get("loc", ())) for e in errors}) - 1
    if more > 0:
        message += f"; and {more} more field{'s' if more > 1 else ''}"
    return ApiError(400, message, param=field)


def install_error_handlers(app: FastAPI) -> None:
    """Turn every refusal into an error object (module docstring)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(400, str(exc)))

    async def dead(request: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(503, str(exc)))

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        path = excerpt(request.url.path, 80)
        messages = {404: f"no route {path}", 405: "method not allowed"}
        message = messages.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message, headers=exc.headers))

    async def failed(request: Request, exc: Exception) -> JSONResponse:
        """The server's own bug: an error object, not a plain-text page (the traceback still
        goes to stderr, as uvicorn logs it)."""
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, failed)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(InvalidRequestError, refused)
    app.add_exception_handler(EngineDeadError, dead)
    app.add_exception_handler(HTTPException, http)
