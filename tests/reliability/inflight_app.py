"""The app the shutdown and hostile-client tests serve: `reliability.inflight_app:app`.

`app` is wrapped with the middleware (defaults), `bare_app` is the same app without it (the
control), `big_app` has `read_ahead=1 MiB` (to see memory follow the bound). Every request with
an `id` query parameter records what happened to it in `$ASGI_CANCEL_EVENTS` (one JSON line per
event, as `tests/servers/events.py` reads them): `start`, then `cancelled` (a `CancelledError`
reached the endpoint) or `done`; `thread-start` and `thread-end` from the worker thread; and
`exit` with the `outcome` the server saw (`returned` or the exception's name).

- `/hello`: 200 "hello".
- `/stats`: `{"tasks": len(asyncio.all_tasks()), "rss_kib": VmRSS}` of the server process.
- `/stream`: a chunk every 20 ms for up to 60 s.
- `/slow?t=S`: sleeps S seconds (60), then "slow done".
- `/thread?t=S`: `time.sleep(S)` (1) in a worker thread (`anyio.to_thread`), then "thread done".
- `/queued`: waits for a slot of a one-slot queue that `/hold` holds forever (an engine busy
  with another request), then "queued done".
- `/upload`: waits until `/open` is called, then reads the whole body and answers
  `<length> <sha256>`; the body it has not read yet is what `read_ahead` bounds.
- `/echo`: reads the whole body at once and answers it back.
- `/open`: opens the gate for every waiting and future `/upload`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any
from urllib.parse import parse_qs

import anyio.to_thread

from asgi_cancel import CancelOnDisconnectMiddleware

from .asgi_parts import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    rss_kib,
    serve_lifespan,
)

EVENTS_ENV = "ASGI_CANCEL_EVENTS"
CHUNK = b"chunk\n"
BIG_READ_AHEAD = 1024 * 1024

_fd: int | None = None
_gate: asyncio.Event | None = None
_slot: asyncio.Semaphore | None = None


def record(request_id: str, event: str, **fields: Any) -> None:
    """One `write` on an O_APPEND file per event (threads cannot interleave)."""
    global _fd
    if request_id == "-":
        return
    now = time.monotonic()
    if _fd is None:
        _fd = os.open(os.environ[EVENTS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    line = json.dumps({"id": request_id, "event": event, "t": now, **fields})
    os.write(_fd, line.encode() + b"\n")


def gate() -> asyncio.Event:
    global _gate
    if _gate is None:
        _gate = asyncio.Event()
    return _gate


def slot() -> asyncio.Semaphore:
    global _slot
    if _slot is None:
        _slot = asyncio.Semaphore(1)
    return _slot


def in_thread(rid: str, seconds: float) -> None:
    record(rid, "thread-start")
    time.sleep(seconds)
    record(rid, "thread-end")


async def endpoint(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    query = parse_qs(scope.get("query_string", b"").decode())
    path = scope["path"]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3000):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/slow":
        await asyncio.sleep(float(query.get("t", ["60"])[0]))
        await respond(send, b"slow done")
    elif path == "/thread":
        await anyio.to_thread.run_sync(in_thread, rid, float(query.get("t", ["1"])[0]))
        await respond(send, b"thread done")
    elif path == "/hold":
        async with slot():
            record(rid, "holding")
            await asyncio.sleep(3600)
    elif path == "/queued":
        async with slot():
            await respond(send, b"queued done")
    elif path == "/upload":
        await gate().wait()
        digest = hashlib.sha256()
        length = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                record(rid, "disconnect-in-body")
                return
            length += len(message.get("body", b""))
            digest.update(message.get("body", b""))
            more_body = message.get("more_body", False)
        await respond(send, f"{length} {digest.hexdigest()}".encode())
    elif path == "/echo":
        await respond(send, await read_body(receive))
    elif path == "/open":
        gate().set()
        await respond(send, b"open")
    elif path == "/stats":
        stats = {"tasks": len(asyncio.all_tasks()), "rss_kib": rss_kib()}
        await respond(send, json.dumps(stats).encode())
    else:
        await respond(send, b"hello")


async def inflight(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    rid = parse_qs(scope.get("query_string", b"").decode()).get("id", ["-"])[0]
    record(rid, "start")
    try:
        await endpoint(scope, receive, send, rid)
    except asyncio.CancelledError:
        record(rid, "cancelled")
        raise
    record(rid, "done")


def recording_exit(wrapped: ASGIApp) -> ASGIApp:
    """Record how the whole app (middleware included) ended: what the server sees."""

    async def app_with_exit_record(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await wrapped(scope, receive, send)
            return
        rid = parse_qs(scope.get("query_string", b"").decode()).get("id", ["-"])[0]
        try:
            await wrapped(scope, receive, send)
        except BaseException as exc:
            record(rid, "exit", outcome=type(exc).__name__)
            raise
        record(rid, "exit", outcome="returned")

    return app_with_exit_record


app = recording_exit(CancelOnDisconnectMiddleware(inflight))
bare_app = recording_exit(inflight)
big_app = recording_exit(CancelOnDisconnectMiddleware(inflight, read_ahead=BIG_READ_AHEAD))
