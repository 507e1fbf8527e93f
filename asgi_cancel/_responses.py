"""What the middleware sends itself: refusals at the edge, and the end of a cancelled request.

Every send here happens after the client left or after the request was stopped, to a server
(or an outer middleware) that may never return: the drivers bound each completion by
`COMPLETION_TIMEOUT`.
"""

from __future__ import annotations

import json
import logging

from ._cycle import STOPPED, Cycle
from .types import Message, Scope, Send

logger = logging.getLogger("asgi_cancel")

# Seconds the middleware waits for the server's send() of its own completion (the 499 after a
# disconnect, the answer to a stopped request): a send that blocks on a dead connection
# (hypercorn over HTTP/2 with data still buffered, an outer middleware) must not keep the
# request, and the server's task, alive forever.
COMPLETION_TIMEOUT = 1.0
_LAST_TRAILERS: Message = {"type": "http.response.trailers", "headers": [], "more_trailers": False}


def error_response(status: int, message: str) -> tuple[Message, Message]:
    """The two ASGI messages of a small JSON error response: `{"error": message}`."""
    body = json.dumps({"error": message}).encode()
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, {"type": "http.response.body", "body": body}


async def refuse(send: Send, status: int, message: str) -> None:
    """Answer a request the app never sees (a malformed header: 400; no budget left: 504)."""
    start, body = error_response(status, message)
    await send(start)
    await send(body)


async def send_cancelled_response(scope: Scope, send: Send) -> None:
    """Complete a request the client left, that the app ended without a response: 499.

    The server drops it (the client is gone), but a middleware outside this one that waits
    for a response gets one instead of raising: Starlette's `BaseHTTPMiddleware` would log
    "RuntimeError: No response returned." for every cancelled request.
    """
    await send({"type": "http.response.start", "status": 499, "headers": []})
    if scope.get("http_version", "1.1") in ("1.0", "1.1"):
        # Not over HTTP/2: there hypercorn hangs on a body sent after the connection closed
        # (the start alone returns), and a response start is all an outer middleware waits for.
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def complete_cancelled(cycle: Cycle, send: Send) -> None:
    """The app of a cancelled request has ended: complete what the server still waits for.

    After a disconnect, a 499 if no response started (`send_cancelled_response`). After
    `stop()` with the client still connected: `cycle.status` with a JSON body if no response
    started, else the end of the started response (a final empty body; trailers if announced).
    A server may refuse a send to a closed connection (ASGI lets it raise OSError): logged at
    DEBUG, never raised.
    """
    try:
        if cycle.disconnect is not STOPPED:  # the client left (possibly after a stop)
            if cycle.first_sent is None:
                await send_cancelled_response(cycle.scope, send)
            return
        if cycle.first_sent is None:
            await refuse(send, cycle.status, cycle.token.reason or "cancelled")
            return
        await _end_started_response(cycle, send)
    except Exception:
        logger.debug("asgi_cancel: completing a cancelled request failed", exc_info=True)


async def _end_started_response(cycle: Cycle, send: Send) -> None:
    first, last = cycle.first_sent, cycle.last_sent
    assert first is not None
    assert last is not None
    if last["type"] == "http.response.trailers":
        if last.get("more_trailers", False):
            await send(dict(_LAST_TRAILERS))
        return
    if last["type"] != "http.response.body" or last.get("more_body", False):
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    if first.get("trailers", False):
        await send(dict(_LAST_TRAILERS))
