"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error.

`EXCEPTION_HANDLERS` make the Starlette app answer that way for its own errors too (unknown
path, wrong method) and for anything unexpected, which is a 500 `server_error`.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .engine import EngineRequestError

logger = logging.getLogger("example_app")


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

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def type_error(name: str, expected: str, value: object) -> OpenAIError:
    return OpenAIError(
        400,
        f"Invalid type for '{name}': expected {expected}, but got {json_type(value)} instead.",
        param=name,
        code="invalid_type",
    )


def unsupported(name: str, what: str) -> OpenAIError:
    return OpenAIError(
        400, f"This example server does not support {what}.", param=name, code="unsupported_value"
    )


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, with an article, as OpenAI words its errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


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
    return OpenAIError(500, "The server had an error processing your request.", type="server_error")


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method not allowed ({request.method} {request.url.path})"
    else:
        message = str(exc.detail)
    error = OpenAIError(exc.status_code, message)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    # The client left while sending its body; nobody will read this.
    return Response(status_code=400)


async def _server_error(request: Request, exc: Exception) -> Response:
    # Starlette logs `exc` after this response is sent.
    error = OpenAIError(
        500, "The server had an error processing your request.", type="server_error"
    )
    return JSONResponse(error.body(), status_code=500)


EXCEPTION_HANDLERS = {
    OpenAIError: _openai_error,
    HTTPException: _http_error,
    ClientDisconnect: _client_disconnect,
    Exception: _server_error,
}
