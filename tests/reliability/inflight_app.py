"""The app the soak, shutdown and hostile-client tests serve: `tests.reliability.inflight_app`.

`app` has the middleware (defaults), `bare_app` not (the control), `big_app` has `read_ahead=1
MiB`. A request with an `id` records `start`, then `cancelled` or `done`; `thread-start` and
`thread-end`; `exit` with the `outcome` the server saw (`returned` or the exception's name).

- `/hello`: 200 "hello".
- `/stream?n=3000&every=0.02`: `n` chunks `b"%05d\\n"`, `every` seconds apart.
- `/slow?t=60`: sleeps `t` seconds, then "slow done".
- `/thread?t=1`: `time.sleep(t)` in a worker thread (`anyio.to_thread`), then "thread done".
- `/queued`: waits for a slot of a one-slot queue that `/hold` holds forever (an engine busy
  with another request), then "queued done".
- `/upload`: waits until `/open` is called, then reads the whole body and answers
  `<length> <sha256>`; the body it has not read yet is what `read_ahead` bounds.
- `/echo`: reads the whole body, answers it back.
- `/open`: opens the gate for every waiting and future `/upload`.
- `/stats`: `{"tasks", "ours", "rss_kib"}` of the server process: every asyncio task, those
  running the middleware's or this app's code, VmRSS; `?stacks=1` adds where each of ours waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from types import CodeType

import anyio.to_thread

from asgi_cancel import CancelOnDisconnectMiddleware

from ..servers import events
from ..servers.events import (
    Receive,
    Scope,
    Send,
    query_param,
    record,
    recording_exit,
    request_id,
    respond,
    serve_lifespan,
)

BIG_READ_AHEAD = 1024 * 1024
OUR_FILES = (__file__, events.__file__)

# Bound to the server's loop at their first use (Python 3.10+).
GATE = asyncio.Event()
SLOT = asyncio.Semaphore(1)


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


async def read_body(receive: Receive, rid: str) -> bytes | None:
    """The whole body, or None if `http.disconnect` came first (the middleware should have
    cancelled the app instead of handing it over)."""
    body = b""
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            record(rid, "disconnect-in-body")
            return None
        body += message.get("body", b"")
        more_body = message.get("more_body", False)
    return body


def in_thread(rid: str, seconds: float) -> None:
    record(rid, "thread-start")
    time.sleep(seconds)
    record(rid, "thread-end")


async def endpoint(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    path = scope["path"]
    if path == "/stream":
        every = float(query_param(scope, "every", "0.02"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for index in range(int(query_param(scope, "n", "3000"))):
            await send({"type": "http.response.body", "body": b"%05d\n" % index, "more_body": True})
            await asyncio.sleep(every)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/slow":
        await asyncio.sleep(float(query_param(scope, "t", "60")))
        await respond(send, b"slow done")
    elif path == "/thread":
        await anyio.to_thread.run_sync(in_thread, rid, float(query_param(scope, "t", "1")))
        await respond(send, b"thread done")
    elif path == "/hold":
        async with SLOT:
            record(rid, "holding")
            await asyncio.sleep(3600)
    elif path == "/queued":
        async with SLOT:
            await respond(send, b"queued done")
    elif path in ("/upload", "/echo"):
        if path == "/upload":
            await GATE.wait()
        body = await read_body(receive, rid)
        if body is not None:
            digest = f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()
            await respond(send, digest if path == "/upload" else body)
    elif path == "/open":
        GATE.set()
        await respond(send, b"open")
    elif path == "/stats":
        await respond(send, json.dumps(stats(bool(query_param(scope, "stacks")))).encode())
    else:
        await respond(send, b"hello")


async def inflight(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    rid = request_id(scope)
    record(rid, "start")
    try:
        await endpoint(scope, receive, send, rid)
    except asyncio.CancelledError:
        record(rid, "cancelled")
        raise
    record(rid, "done")


def stats(stacks: bool) -> dict[str, object]:
    tasks = asyncio.all_tasks()
    ours = [task for task in tasks if runs_our_code(task)]
    found: dict[str, object] = {"tasks": len(tasks), "ours": len(ours), "rss_kib": rss_kib()}
    if stacks:  # where each of our tasks waits: the soak's finding, shown
        found["stacks"] = [where(task) for task in ours]
    return found


def awaited(task: asyncio.Task[object]) -> Iterator[tuple[object, CodeType | None]]:
    """The task's await chain, outermost first: each awaitable and its code, if it has one."""
    awaitable: object = task.get_coro()
    while awaitable is not None:
        yield awaitable, getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)


def runs_our_code(task: asyncio.Task[object]) -> bool:
    """Whether the task's await chain passes through the middleware or this app.

    The server's own connection tasks are not ours: hypercorn keeps idle-timeout tasks of
    connections the clients reset for a long time, with or without the middleware.
    """
    return any(
        code is not None and ("asgi_cancel" in code.co_filename or code.co_filename in OUR_FILES)
        for _, code in awaited(task)
    )


def where(task: asyncio.Task[object]) -> list[str]:
    """`function file:line` per frame of the await chain, down to what is not a coroutine."""
    chain = []
    for awaitable, code in awaited(task):
        if code is None:
            chain.append(repr(awaitable)[:200])
            break
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        line = frame.f_lineno if frame is not None else "-"
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
        chain.append(f"{name} {code.co_filename.rsplit('/', 2)[-1]}:{line}")
    return chain


app = recording_exit(CancelOnDisconnectMiddleware(inflight))
bare_app = recording_exit(inflight)
big_app = recording_exit(CancelOnDisconnectMiddleware(inflight, read_ahead=BIG_READ_AHEAD))
