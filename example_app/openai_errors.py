"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error.

`EXCEPTION_HANDLERS` make an app answer that way for its own errors too (unknown path, wrong
method) and for anything unexpected, which is a 500 `server_error`; `validation_handlers` add
FastAPI's `RequestValidationError`, each pydantic error worded and coded as OpenAI does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .engine import EngineRequestError

logger = logging.getLogger("example_app")
Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response, and of a stream's error event."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def response_body(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)


# pydantic's error type -> OpenAI's code; `*_type` is "invalid_type", our custom types are codes.
CODES = {
    "missing": "missing_required_parameter",
    "finite_number": "invalid_value",
    "literal_error": "invalid_value",
    "too_short": "empty_array",
    "too_long": "array_above_max_length",
}


def param_name(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "content")` -> `"messages[0].content"`; None for the body."""
    name = ""
    for part in loc[1:]:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name or None


def from_validation_error(error: dict[str, Any]) -> OpenAIError:
    """One pydantic error (an item of `RequestValidationError.errors()`) as OpenAI's 400."""
    kind, context, param = error["type"], error.get("ctx") or {}, param_name(error["loc"])
    code = "invalid_type" if kind.endswith("_type") else CODES.get(kind, kind)
    if kind in ("greater_than_equal", "less_than_equal"):  # integer_below_min_value, ...
        number = "integer" if isinstance(context.get("ge", context.get("le")), int) else "decimal"
        code = f"{number}_{'below_min' if kind == 'greater_than_equal' else 'above_max'}_value"
    message = f"Invalid '{param or 'request body'}': {error['msg']}."
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    # OpenAI and vLLM answer 404 here, and the openai client raises NotFoundError.
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def from_engine_error(error: EngineRequestError) -> OpenAIError:
    return OpenAIError(400, error.message, param=error.param, code="invalid_value")


def aborted() -> OpenAIError:
    # Reached only if something other than this request's client aborted it (engine shutdown).
    return OpenAIError(503, "The engine aborted the request.", type="server_error")


def shutting_down() -> OpenAIError:
    # The server was asked to stop (Ctrl-C, SIGTERM) while the request was generating.
    return OpenAIError(
        503,
        "The server is shutting down; the request was not completed.",
        type="server_error",
        code="server_shutting_down",
    )


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineRequestError):
        return from_engine_error(exc)
    logger.error("generation failed", exc_info=exc)
    return internal_error()


def internal_error() -> OpenAIError:
    return OpenAIError(500, "The server had an error processing your request.", type="server_error")


def error_response(error: OpenAIError, headers: Mapping[str, str] | None = None) -> Response:
    body = error.response_body().model_dump_json()
    return Response(body, error.status, headers, media_type="application/json")


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method not allowed ({request.method} {request.url.path})"
    else:
        message = str(exc.detail)
    return error_response(OpenAIError(exc.status_code, message), exc.headers)


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    # The client left while sending its body; nobody will read this.
    return Response(status_code=400)


async def _server_error(request: Request, exc: Exception) -> Response:
    # Starlette logs `exc` after this response is sent.
    return error_response(internal_error())


EXCEPTION_HANDLERS: dict[Any, Handler] = {
    OpenAIError: _openai_error,
    HTTPException: _http_error,
    ClientDisconnect: _client_disconnect,
    Exception: _server_error,
}


def validation_handlers(models: Collection[str]) -> dict[Any, Handler]:
    """`EXCEPTION_HANDLERS` and FastAPI's `RequestValidationError` answered as OpenAI does.

    An unknown model is a 404 before any other error in the body, as OpenAI and vLLM answer;
    otherwise the first pydantic error is the 400 (its `loc` names the `param`).
    """

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        model = exc.body.get("model") if isinstance(exc.body, dict) else None
        if isinstance(model, str) and model not in models:
            return error_response(model_not_found(model))
        return error_response(from_validation_error(exc.errors()[0]))

    return {**EXCEPTION_HANDLERS, RequestValidationError: validation_error}
