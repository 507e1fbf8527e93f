"""A raw ASGI app that runs on asyncio and trio servers alike, served by every server under test.
Each endpoint records what happens to it (`events.record`), keyed by the `id` query parameter:

- `/hello`: 200 "hello" at once.
- `/slow?t=30`: sleeps `t` seconds, then answers 200 "slow done"; its `start` event has the
  token's `request_id` (with a registry, the caller's `X-Request-Id`).
- `/stream`: a chunk every 20 ms for up to 30 s.
- `/bg?work=0.3`: answers 200 "bg" at once, then keeps working `work` seconds (post-response
  work, as Starlette's `BackgroundTasks`), recording whether the token was cancelled.
- `/upload?read=1`: reads the whole body first (or, with `read=0`, sleeps first), then sleeps.

`app` is the probe wrapped with the middleware; `bare_app` is the same probe without it, to
measure what a server does on its own (token fields are then recorded as None).
"""

from __future__ import annotations

import asyncio

import sniffio
import trio

from asgi_cancel import CancelOnDisconnectMiddleware

from .events import (
    Receive,
    Scope,
    Send,
    log_cancellations_to_stderr,
    query_param,
    record,
    record_hook,
    recording_exit,
    request_id,
    respond,
    serve_lifespan,
    token_state,
)

CHUNK = b"chunk\n"
CHUNK_INTERVAL = 0.02
CANCELLED = (asyncio.CancelledError, trio.Cancelled)


async def sleep(seconds: float) -> None:
    # Not anyio.sleep: its first call imports anyio's backend module, which blocks the event
    # loop for tens of ms, right when the first test closes its connection.
    if sniffio.current_async_library() == "trio":
        await trio.sleep(seconds)
    else:
        await asyncio.sleep(seconds)


async def slow(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    record(rid, "start", **token_state())
    await sleep(float(query_param(scope, "t", "30")))
    await respond(send, b"slow done")


async def stream(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    record(rid, "start")
    for _ in range(int(30 / CHUNK_INTERVAL)):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await sleep(CHUNK_INTERVAL)
    await send({"type": "http.response.body", "body": b""})


async def background(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    record(rid, "start")
    await respond(send, b"bg")
    # The response is complete: the client may now leave, this work must not be cancelled.
    await sleep(float(query_param(scope, "work", "0.3")))
    record(rid, "bg_done", **token_state())


async def upload(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    record(rid, "start")
    if query_param(scope, "read", "1") == "0":
        await sleep(30)
    received = 0
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            # The middleware should have cancelled us instead of handing this over.
            record(rid, "disconnect_message", received=received)
            return
        received += len(message.get("body", b""))
        more_body = message.get("more_body", False)
        record(rid, "received", received=received)
    await sleep(30)
    await respond(send, b"upload done")


async def hello(rid: str, scope: Scope, receive: Receive, send: Send) -> None:
    await respond(send, b"hello")


ROUTES = {"/slow": slow, "/stream": stream, "/bg": background, "/upload": upload}


async def probe(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    rid = request_id(scope)
    endpoint = ROUTES.get(scope["path"], hello)
    try:
        await endpoint(rid, scope, receive, send)
    except CANCELLED as exc:
        record(rid, "cancelled", exc=type(exc).__name__, **token_state())
        raise
    record(rid, "done")


log_cancellations_to_stderr()
app = recording_exit(CancelOnDisconnectMiddleware(probe, on_cancelled=record_hook))
bare_app = recording_exit(probe)
