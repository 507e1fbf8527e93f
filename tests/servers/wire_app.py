"""One raw ASGI app for tests/servers/test_wire.py: the same endpoints bare (`/bare/...`) and
under the middleware (`/wrapped/...`), so that one server process compares both on the wire.

- `/hello`: 200 "hello" (the runner's readiness probe).
- `/<prefix>/slow?t=S`: sleeps, then 200 "slow"; never calls `receive()`.
- `/<prefix>/refuse`: 401 after 50 ms, without reading its body (`Expect: 100-continue`).
- `/<prefix>/stream?kind=chunked|length|sse`: a chunk every 20 ms for 3 s (a deadline from
  `x-request-timeout` cuts it under the middleware).
- `/<prefix>/id`: 200 with the request id the middleware gave it.
- `/hung/slow`: `/wrapped/slow` behind an outer middleware whose `send` never returns once
  its client left (hypercorn-h2's send, or any outer middleware, can do that).
- `/inflight`: how many requests of this app have not returned yet.
"""

from __future__ import annotations

import asyncio
from typing import Any

import sniffio
import trio

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token

from .events import Message, Receive, Scope, Send, query_param, serve_lifespan

CHUNK = b"x" * 32
INTERVAL = 0.02
CHUNKS = 150
inflight = 0


async def sleep(seconds: float) -> None:
    if sniffio.current_async_library() == "trio":
        await trio.sleep(seconds)
    else:
        await asyncio.sleep(seconds)


async def answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def stream(scope: Scope, send: Send) -> None:
    kind = query_param(scope, "kind", "chunked")
    headers = [(b"content-type", b"text/event-stream" if kind == "sse" else b"text/plain")]
    if kind == "length":
        headers.append((b"content-length", str(len(CHUNK) * CHUNKS).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for _ in range(CHUNKS):
        chunk = b"data: " + CHUNK + b"\n\n" if kind == "sse" else CHUNK
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await sleep(INTERVAL)
    await send({"type": "http.response.body", "body": b""})


async def endpoints(scope: Scope, receive: Receive, send: Send) -> None:
    global inflight
    inflight += 1
    try:
        name = scope["path"].rsplit("/", 1)[-1]
        if name == "slow":
            await sleep(float(query_param(scope, "t", "1")))
            await answer(send, 200, b"slow")
        elif name == "refuse":
            await sleep(0.05)
            await answer(send, 401, b"refused")
        elif name == "stream":
            await stream(scope, send)
        elif name == "id":
            await answer(send, 200, (current_token().request_id or "").encode())
        else:
            await answer(send, 404, b"no such endpoint")
    finally:
        inflight -= 1


def hung_after_disconnect(inner: Any) -> Any:
    """An outer middleware whose send blocks forever once its client has gone."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def hanging_send(message: Message) -> None:
            if gone:
                await sleep(3600)
            await send(message)

        await inner(scope, watching_receive, hanging_send)

    return middleware


wrapped = CancelOnDisconnectMiddleware(
    endpoints, registry=CancelRegistry(), timeout_header="x-request-timeout"
)
hung = hung_after_disconnect(wrapped)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    path = scope["path"]
    if path == "/inflight":
        await answer(send, 200, str(inflight).encode())
    elif path.startswith("/bare/"):
        await endpoints(scope, receive, send)
    elif path.startswith("/wrapped/"):
        await wrapped(scope, receive, send)
    elif path.startswith("/hung/"):
        await hung(scope, receive, send)
    else:
        await answer(send, 200, b"hello")
