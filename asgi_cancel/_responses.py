"""What the middleware sends itself: refusals at the edge, and the end of a cancelled request.

Every send here happens after the client left or after the request was stopped, to a server
(or an outer middleware) that may never return: the drivers bound each completion by
`COMPLETION_TIMEOUT`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ._cycle import Cycle
from ._messages import body_complete, is_event_stream
from ._servers import abort
from .types import Message, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")

# Seconds the middleware waits for the server's send() of its own completion (the 499 after a
# disconnect, the answer to a stopped request): a send that blocks on a dead connection
# (hypercorn over HTTP/2 with data still buffered, an outer middleware) must not keep the
# request, and the server's task, alive forever.
COMPLETION_TIMEOUT = 1.0
# A websocket stopped by the middleware is closed with the status an HTTP request would get, in
# the range RFC 6455 leaves to applications: 4499 cancelled, 4504 deadline exceeded, 4400.
WEBSOCKET_CLOSE_CODES = 4000
_LAST_TRAILERS: Message = {"type": "http.response.trailers", "headers": [], "more_trailers": False}


def error_response(status: int, message: str, *, prefix: str = "") -> tuple[Message, Message]:
    """The two ASGI messages of a small JSON error response: `{"error": message}` (`prefix`:
    `"websocket."` for a websocket's denial response)."""
    body = json.dumps({"error": message}).encode()
    start: Message = {
        "type": prefix + "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, {"type": prefix + "http.response.body", "body": body}


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    """Answer a request the app never sees (a malformed header: 400; no budget left: 504).

    A websocket handshake is refused with that response where the server offers ASGI's denial
    response, else with a close before the accept (the server answers 403), its code the
    status in the private range (`4000 + status`) and its reason `message`."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect: what the app would have read first
        if "websocket.http.response" not in scope.get("extensions", {}):
            code = WEBSOCKET_CLOSE_CODES + status
            await send({"type": "websocket.close", "code": code, "reason": message})
            return
        start, body = error_response(status, message, prefix="websocket.")
    else:
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


async def complete_stopped(cycle: Cycle[Any], receive: Receive, send: Send) -> None:
    """The app of a stopped request has ended: complete what the server still waits for.

    After a disconnect, a 499 if no response started (`send_cancelled_response`). After
    `stop()` with the client still connected: its status with a JSON body if no response
    started; a response whose body was complete gets its end (trailers if announced); a body
    cut short is made recognisable as cut (`_cut`). A server may refuse a send to a closed
    connection (ASGI lets it raise OSError): logged at DEBUG, never raised.
    """
    status = cycle.stopped_with
    assert status is not None  # (only stopped requests are completed)
    try:
        if not cycle.stopped:  # the client left
            if cycle.first_sent is None:
                await send_cancelled_response(cycle.scope, send)
            return
        if cycle.first_sent is None:
            await refuse(
                cycle.scope, receive, send, status, cycle.cancel_scope.reason or "cancelled"
            )
            return
        delivered = cycle.delivered
        assert delivered is not None  # (a response started)
        if not body_complete(delivered) and await _cut(cycle, receive, send):
            return
        await _end_started_response(cycle, send)
    except Exception:
        logger.debug("completing a cancelled request failed", exc_info=True)


async def _cut(cycle: Cycle[Any], receive: Receive, send: Send) -> bool:
    """End a body cut short so that the client can tell; returns True if nothing more is to
    be sent. An event stream gets an SSE `error` event (the openai client raises `APIError`,
    an `EventSource` page gets an `error` event) and then a clean end; any other body, a
    connection the server closes quietly (`_servers.abort`): httpx raises
    `RemoteProtocolError`, curl exits 18, a browser's fetch rejects. Where the server is not
    recognised, or over HTTP/2, the body is ended cleanly: the cut is only in our log line."""
    assert cycle.first_sent is not None
    if is_event_stream(cycle.first_sent):
        reason = cycle.cancel_scope.reason or "cancelled"
        error = {"message": reason, "type": reason.replace(" ", "_"), "code": cycle.stopped_with}
        event = b"event: error\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
        return False
    aborted: bool = await abort(cycle.scope, receive, send)
    return aborted


async def _end_started_response(cycle: Cycle[Any], send: Send) -> None:
    first, last = cycle.first_sent, cycle.delivered
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
