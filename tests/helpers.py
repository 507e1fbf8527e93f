"""Tiny ASGI apps and server stand-ins shared by the ASGI-level tests."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable

from asgi_cancel.testing import http_scope
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

WATCHDOG = 5.0


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request", message
        body += bytes(message.get("body", b""))
        if not message.get("more_body", False):
            return body


async def respond(send: Send, body: bytes = b"ok", status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


def slow_app(events: list[str], *, seconds: float = 30.0, read: bool = True) -> ASGIApp:
    """Reads the body (or not), then sleeps; records how it ended."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if read:
            events.append("body:" + (await read_body(receive)).decode())
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        await respond(send)
        events.append("finished")

    return app


def streaming_app(events: list[str], *, chunks: int = 1000, interval: float = 0.005) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for index in range(chunks):
                await send(
                    {"type": "http.response.body", "body": b"%d\n" % index, "more_body": True}
                )
                await asyncio.sleep(interval)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        await send({"type": "http.response.body", "body": b""})
        events.append("finished")

    return app


class QueueServer:
    """A hypercorn-like server side: body messages queued, one disconnect, then blocks forever."""

    def __init__(self, *messages: Message) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        for message in messages:
            self.queue.put_nowait(message)
        self.sent: list[Message] = []
        self.receive_calls = 0

    async def receive(self) -> Message:
        self.receive_calls += 1
        return await self.queue.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})


async def receive_once(receive: Receive) -> Message:
    """`receive()` as a coroutine, for asyncio.create_task()."""
    return await receive()


async def until(predicate: Callable[[], bool], *, timeout: float = WATCHDOG) -> None:
    """Yield to the loop until `predicate()` holds; fail the test after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"watchdog: condition not met within {timeout} s")
        await asyncio.sleep(0.001)


async def with_watchdog(awaitable: Awaitable[object], timeout: float = WATCHDOG) -> object:
    return await asyncio.wait_for(awaitable, timeout)


async def run_capturing(
    app: ASGIApp, receive: Receive, send: Send, scope: Scope | None = None
) -> BaseException | None:
    """Run the middleware-wrapped `app` like a server task; return what escaped, if anything."""
    try:
        await app(scope if scope is not None else http_scope(), receive, send)
    except BaseException as exc:  # the test inspects it
        return exc
    return None


class KeepAliveServer:
    """A server's per-request object whose final `send` copies the current context, as
    uvicorn's does when it arms its keep-alive timer (`loop.call_later()` inside that send)."""

    def __init__(self) -> None:
        self.kept: list[contextvars.Context] = []

    async def receive(self) -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.kept.append(contextvars.copy_context())
