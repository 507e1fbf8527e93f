"""The app of tests/servers/test_cluster.py: one process of a deployment that cancels by id
through Redis (`$ASGI_CANCEL_REDIS_URL`).

- `/hello`; `/whoami`: this process's pid.
- `/slow?id=ID` (request id `ID` in `X-Request-Id`): records `start` with the pid, then
  sleeps until cancelled (records `cancelled`).
- `/v1/requests/{id}` (DELETE): the cancel endpoint, answering with `x-worker-pid`.
"""

from __future__ import annotations

import asyncio
import os

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, cancel_endpoint
from asgi_cancel.redis import RedisBroker

from .events import Message, Receive, Scope, Send, record, request_id, respond, serve_lifespan

registry = CancelRegistry(broker=RedisBroker(os.environ["ASGI_CANCEL_REDIS_URL"], wait=2.0))
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

    scope["root_path"] = "/v1/requests"
    await endpoint(scope, receive, send_with_pid)


middleware = CancelOnDisconnectMiddleware(slow, registry=registry)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
    elif scope["path"].startswith("/v1/requests/"):
        await with_pid(scope, receive, send)
    elif scope["path"] == "/slow":
        await middleware(scope, receive, send)
    elif scope["path"] == "/whoami":
        await respond(send, PID)
    else:
        await respond(send, b"hello")
