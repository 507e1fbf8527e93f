"""The app the soak and shutdown tests serve: `reliability.soak_app:app` (and `bare_app`).

- `/hello`: 200 "hello".
- `/echo` (POST): reads the body, answers it back.
- `/stream?n=K`: K chunks `b"%05d\\n"`, 2 ms apart.
- `/slow?t=S`: sleeps S seconds, then "slow done".
- `/thread?t=S`: sleeps S seconds in a worker thread, then "thread done".
- `/stats`: `{"tasks": len(asyncio.all_tasks()), "rss_kib": VmRSS}` of the server process.

Each request's end is printed to stderr only when something unexpected escapes the app.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import parse_qs

from asgi_cancel import CancelOnDisconnectMiddleware

from .asgi_parts import Receive, Scope, Send, read_body, respond, rss_kib, serve_lifespan


def chunk(index: int) -> bytes:
    return b"%05d\n" % index


async def soak(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    query = parse_qs(scope.get("query_string", b"").decode())
    path = scope["path"]
    if path == "/echo":
        await respond(send, await read_body(receive))
    elif path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for index in range(int(query.get("n", ["50"])[0])):
            await send({"type": "http.response.body", "body": chunk(index), "more_body": True})
            await asyncio.sleep(0.002)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/slow":
        await asyncio.sleep(float(query.get("t", ["0.05"])[0]))
        await respond(send, b"slow done")
    elif path == "/thread":
        await asyncio.to_thread(time.sleep, float(query.get("t", ["0.05"])[0]))
        await respond(send, b"thread done")
    elif path == "/stats":
        tasks = asyncio.all_tasks()
        ours = [task for task in tasks if runs_our_code(task)]
        stats: dict[str, object] = {"tasks": len(tasks), "ours": len(ours), "rss_kib": rss_kib()}
        if "stacks" in query:  # where each of our tasks waits: the soak's finding, shown
            stats["stacks"] = [await_chain(task) for task in ours]
        await respond(send, json.dumps(stats).encode())
    else:
        await respond(send, b"hello")


def await_chain(task: asyncio.Task[object]) -> list[str]:
    """The task's await chain, outermost first: `function file:line` per frame."""
    chain = []
    awaitable: object = task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if code is None:
            chain.append(repr(awaitable)[:200])
            break
        line = frame.f_lineno if frame is not None else "-"
        name = getattr(code, "co_qualname", code.co_name)
        chain.append(f"{name} {code.co_filename.rsplit('/', 2)[-1]}:{line}")
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return chain


def runs_our_code(task: asyncio.Task[object]) -> bool:
    """Whether the task's await chain passes through the middleware or this app.

    The server's own connection tasks are not ours: hypercorn keeps idle-timeout tasks of
    connections the clients reset for a long time, with or without the middleware.
    """
    awaitable: object = task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        filename = getattr(code, "co_filename", "")
        if "asgi_cancel" in filename or filename == __file__:
            return True
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return False


app = CancelOnDisconnectMiddleware(soak)
bare_app = soak
