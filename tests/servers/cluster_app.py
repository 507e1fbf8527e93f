"""The app of tests/servers/test_cluster.py: one process of a deployment that cancels by id
through Redis (`$ASGI_CANCEL_REDIS_URL`; the broker's `health_timeout` from
`$ASGI_CANCEL_REDIS_HEALTH`, 10 s without it).

- `/hello`; `/whoami`: this process's pid.
- `/slow?id=ID` (request id `ID` in `X-Request-Id`): records `start` with the pid, then
  sleeps until cancelled (records `cancelled`).
- `/requests/{id}` (DELETE): the cancel endpoint, answering with `x-worker-pid`.
"""

from __future__ import annotations

import asyncio
import os

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, cancel_endpoint
from asgi_cancel.redis import RedisBroker

from .events import Message, Receive, Scope, Send, record, request_id, respond, serve_lifespan

broker = RedisBroker(
    os.environ["ASGI_CANCEL_REDIS_URL"],
    wait=2.0,
    health_timeout=float(os.environ.get("ASGI_CANCEL_REDIS_HEALTH", "10")),
)
registry = CancelRegistry(broker=broker)
endpoint = cancel_endpoint(registry, authorize=None)
PID = str(os.getpid()).encode()


async def slow(scope: Scope, receive: Receive, send: Send) -> None:
    rid = request_id(scope)
    record(rid, "start", pid=os.getpid())
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        record(rid, "cancelled", pid=os.getpid())
        raise
    await respond(send, b"slow")


async def with_pid(scope: Scope, receive: Receive, send: Send) -> None:
    async def send_with_pid(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], (b"x-worker-pid", PID)]}
        await send(message)

    scope["root_path"] = "/requests"
    await endpoint(scope, receive, send_with_pid)


middleware = CancelOnDisconnectMiddleware(slow, registry=registry)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
    elif scope["path"].startswith("/requests/"):
        await with_pid(scope, receive, send)
    elif scope["path"] == "/slow":
        await middleware(scope, receive, send)
    elif scope["path"] == "/whoami":
        await respond(send, PID)
    else:
        await respond(send, b"hello")
