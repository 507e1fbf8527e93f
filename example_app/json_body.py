"""Request bodies read as OpenAI's API reads them, before FastAPI validates them.

`JSONBodyRoute` reads at most `MAX_BODY` (413 beyond) and decodes strict JSON whatever the
content type: no `NaN`, and bad UTF-8, 5000-digit integers or deep nesting are a 400 in
OpenAI's words, not FastAPI's generic "There was an error parsing the body" or a 500.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from .openai_errors import OpenAIError

MAX_BODY = 1024 * 1024


class JSONBodyRoute(APIRoute):
    """An `APIRoute` whose body FastAPI gets read and decoded as above."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle_json_body(request: Request) -> Response:
            body = await _read_body(request)
            return await handler(_ParsedRequest(request.scope, request.receive, body))

        return handle_json_body


class _ParsedRequest(Request):
    def __init__(self, scope: Scope, receive: Receive, body: bytes) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        # FastAPI decodes the body as JSON only for a JSON content type; OpenAI ignores it.
        headers.append((b"content-type", b"application/json"))
        super().__init__({**scope, "headers": headers}, receive)
        self._decoded = parse_json_body(body)
        self._raw = body

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._decoded


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise _too_large()
    return bytes(body)


def _too_large() -> OpenAIError:
    return OpenAIError(413, f"Request body too large: the limit is {MAX_BODY} bytes.")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # also bad UTF-8, NaN/Infinity, 5000-digit integers
        raise OpenAIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
            "but what was sent was not valid JSON.)",
        ) from None
