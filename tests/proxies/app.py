"""The app behind every proxy: asgi-cancel around one endpoint per way a client leaves (before
the first byte, mid-SSE, mid-`Content-Length` answer, mid-upload), each recording its events
(`tests.servers.events.record`) keyed by the `id` query parameter. `streaming` is recorded once
three pieces were sent. The app works `WORK` seconds at most, so a request a proxy never
cancels ends by itself.
"""

from __future__ import annotations

import asyncio

from asgi_cancel import CancelOnDisconnectMiddleware

from ..servers.events import (
    Receive,
    Scope,
    Send,
    query_param,
    record,
    record_hook,
    recording_exit,
    request_id,
    respond,
    serve_lifespan,
)

WORK = 5.0
INTERVAL = 0.02
PIECES = int(WORK / INTERVAL)
PIECE = b"x" * 1023 + b"\n"
STARTED_AFTER = 3  # pieces sent before `streaming` is recorded


async def slow(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    record(rid, "start")
    await asyncio.sleep(float(query_param(scope, "t", str(WORK))))
    await respond(send, b"slow done")


async def pieces(rid: str, send: Send, headers: list[tuple[bytes, bytes]], piece: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    record(rid, "start")
    for sent in range(1, PIECES + 1):
        await send({"type": "http.response.body", "body": piece, "more_body": sent < PIECES})
        if sent == STARTED_AFTER:
            record(rid, "streaming")
        if sent < PIECES:
            await asyncio.sleep(INTERVAL)


async def sse(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await pieces(rid, send, headers, b"data: token\n\n")


async def body(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % (PIECES * len(PIECE))),
    ]
    await pieces(rid, send, headers, PIECE)


async def upload(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    record(rid, "start")
    received = 0
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":  # the middleware cancels before this
            record(rid, "disconnect_message", received=received)
            return
        received += len(message.get("body", b""))
        more_body = message.get("more_body", False)
        record(rid, "received", received=received)
    await asyncio.sleep(WORK)
    await respond(send, b"upload done")


async def hello(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    await respond(send, b"hello")


ROUTES = {"/slow": slow, "/sse": sse, "/body": body, "/upload": upload}


async def endpoints(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    rid = request_id(scope)
    endpoint = ROUTES.get(scope["path"], hello)
    try:
        await endpoint(rid, scope, receive, send)
    except asyncio.CancelledError:
        record(rid, "cancelled")
        raise
    record(rid, "done")


app = recording_exit(CancelOnDisconnectMiddleware(endpoints, on_cancelled=record_hook))
