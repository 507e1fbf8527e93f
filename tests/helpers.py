"""Tiny ASGI apps, server stand-ins and watchdog'd waits shared by the ASGI-level tests.

All loop-agnostic (anyio), the tests that use them run on asyncio and on trio alike; but
`Node`, a process of its own: an asyncio loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
import pytest
import sniffio

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, cancel_endpoint, current_token
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

WATCHDOG = 5.0
DISCONNECT: Message = {"type": "http.disconnect"}
REQUEST_DONE: Message = {"type": "http.request", "body": b"", "more_body": False}
# What the middleware completes a cancelled HTTP/1.1 request with, for an outer middleware.
CANCELLED_RESPONSE: list[Message] = [
    {"type": "http.response.start", "status": 499, "headers": []},
    {"type": "http.response.body", "body": b"", "more_body": False},
]
T = TypeVar("T")


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


@contextlib.contextmanager
def noting_cancellation(events: list[str]) -> Iterator[None]:
    """Append "cancelled" to `events` if a cancellation leaves the block (it goes on)."""
    try:
        yield
    except anyio.get_cancelled_exc_class():
        events.append("cancelled")
        raise


def slow_app(
    events: list[str],
    *,
    seconds: float = 30.0,
    read: bool = True,
    stream: bool = False,
    callback: bool = False,
    first: Callable[[], object] = lambda: None,
) -> ASGIApp:
    """Calls `first()`, reads the body (or not), maybe starts a stream, sleeps, then responds;
    records `body:<body>`, `callback:<reason>` (an `on_cancel` callback, with `callback=True`)
    and how it ended: `cancelled` or `finished`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        first()
        if callback:
            token = current_token()
            token.on_cancel(lambda: events.append(f"callback:{token.reason}"))
        if read:
            events.append("body:" + (await read_body(receive)).decode())
        with noting_cancellation(events):
            if stream:
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await anyio.sleep(seconds)
        events.append("finished")
        if not stream:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


class QueueServer:
    """A hypercorn-like server side: the messages put in, in order, then it blocks forever."""

    def __init__(self, *messages: Message) -> None:
        self.messages: deque[Message] = deque(messages)
        self._arrived: anyio.Event | None = None
        self.sent: list[Message] = []
        self.receive_calls = 0

    async def receive(self) -> Message:
        self.receive_calls += 1
        while not self.messages:  # cancelled while waiting, nothing is lost
            self._arrived = self._arrived or anyio.Event()
            await self._arrived.wait()
        return self.messages.popleft()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def put(self, message: Message) -> None:
        self.messages.append(message)
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def disconnect(self) -> None:
        self.put(DISCONNECT)

    async def feed(self, chunks: list[bytes], interval: float) -> None:
        """The client uploads `chunks`, one every `interval` seconds."""
        for index, chunk in enumerate(chunks):
            more = index < len(chunks) - 1
            self.put({"type": "http.request", "body": chunk, "more_body": more})
            await anyio.sleep(interval)


class KeepAliveServer:
    """A server's per-request object whose final `send` copies the current context, as
    uvicorn's does when it arms its keep-alive timer (`loop.call_later()` inside that send)."""

    def __init__(self) -> None:
        self.kept: list[contextvars.Context] = []

    async def receive(self) -> Message:
        return REQUEST_DONE

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.kept.append(contextvars.copy_context())


async def receive_into(messages: list[Message], receive: Receive) -> None:
    """One `receive()`, for a task of its own."""
    messages.append(await receive())


async def until(predicate: Callable[[], bool], *, interval: float = 0.001) -> None:
    """Check `predicate()` every `interval` seconds (0: every loop iteration) until it holds;
    fail the test after `WATCHDOG` seconds (a caller's `fail_after` may say sooner)."""
    with anyio.fail_after(WATCHDOG):
        while not predicate():  # noqa: ASYNC110 (conditions on foreign state, polled)
            await anyio.sleep(interval)


async def with_watchdog(awaitable: Awaitable[T]) -> T:
    with anyio.fail_after(WATCHDOG):
        return await awaitable


def watching(conn: ClientConnection) -> bool:
    """Someone (the app or the middleware's watcher) waits in `receive()` after the body."""
    return conn.receive_calls >= 2


async def leave(
    app: ASGIApp,
    conn: ClientConnection | None = None,
    scope: Scope | None = None,
    *,
    when: Callable[[], bool] | None = None,
    interval: float = 0.001,
) -> ClientConnection:
    """Run `app` for a client (`conn`, a fresh one by default) that leaves once `when()` holds
    (by default once the connection is `watching`; checked as `until` does); return when the
    app has finished, with what escaped it in `conn.app_exception`."""
    conn = conn if conn is not None else ClientConnection()
    ready = when if when is not None else lambda: watching(conn)
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(run_quietly, conn, app, scope)
            await until(ready, interval=interval)
            conn.disconnect()
    return conn


@contextlib.asynccontextmanager
async def running(
    app: ASGIApp, scope: Scope | None = None, conn: ClientConnection | None = None
) -> AsyncIterator[ClientConnection]:
    """`app` serving one request for a client (`conn`, a fresh one by default) that stays while
    the block runs; the block's end waits for the app (watchdog'd)."""
    conn = conn if conn is not None else ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, app, scope)
            yield conn


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> AsyncIterator[None]:
    """`app` called as a server would, running while the block runs; the block's end waits for
    it (watchdog'd)."""
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(call, app, scope, receive, send)
            yield


async def served(app: ASGIApp, scope: Scope | None = None) -> ClientConnection:
    """`app` serving one request for a client that stays (watchdog'd)."""
    conn = ClientConnection()
    await with_watchdog(conn.run(app, scope))
    return conn


async def call(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    await app(scope, receive, send)


async def run_quietly(conn: ClientConnection, app: ASGIApp, scope: Scope | None = None) -> None:
    """`conn.run(app)`, its exception left in `conn.app_exception` rather than raised."""
    with contextlib.suppress(Exception):
        await conn.run(app, scope)


def cleanup_scope() -> anyio.CancelScope:
    """Where a cancelled app's cleanup awaits: shielded on trio, whose cancellation is
    level-triggered; not on asyncio, where it is one `Task.cancel()` and the cleanup must not
    be cancelled again."""
    return anyio.CancelScope(shield=sniffio.current_async_library() == "trio")


def xfail_on(loop: str, request: pytest.FixtureRequest, when: bool = True, *, reason: str) -> None:
    """A strict xfail for this test on one loop (`when` narrows it to some of its parameters)."""
    on_loop = request.node.callspec.params["anyio_backend"] == loop
    request.applymarker(pytest.mark.xfail(on_loop and when, strict=True, reason=reason))


def tasks_alive() -> int:
    return len(anyio.get_running_tasks())


NODE_WATCHDOG = 10.0


class Node:
    """One process of a deployment: an asyncio loop in a thread, a registry, and a broker on the
    Redis at `url` (none without)."""

    def __init__(
        self, url: str | None, name: str, *, wait: float = 1.0, health_timeout: float = 10.0
    ) -> None:
        from asgi_cancel.redis import RedisBroker  # its extra, only where a test asks for a broker

        self.name = name
        self.broker: Any = None
        if url is not None:
            self.broker = RedisBroker(
                url, wait=wait, connect_timeout=0.3, health_timeout=health_timeout
            )
        self.registry = CancelRegistry(broker=self.broker, remember=2.0)
        self.events: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.loop.call_soon_threadsafe(self.registry.started)  # its broker starts in its loop

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(NODE_WATCHDOG)

    def block(self, seconds: float) -> None:
        """Keep the loop busy (a long synchronous step) for `seconds`."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def wait_connected(self, connected: bool = True) -> None:
        deadline = time.monotonic() + NODE_WATCHDOG
        while self.broker.connected is not connected:
            assert time.monotonic() < deadline, f"{self.name}: broker connected != {connected}"
            time.sleep(0.01)

    def start_request(self, request_id: str, alias: str | None = None) -> Future[ClientConnection]:
        """A request with `request_id` (and `alias`, if given) that sleeps until cancelled (its
        app records how)."""

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if alias is not None:
                assert self.registry.alias(alias)
            self.events.append(f"{request_id} started")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.events.append(f"{request_id} cancelled")
                raise

        async def serve() -> ClientConnection:
            conn = ClientConnection()
            scope = http_scope(headers=[(b"x-request-id", request_id.encode())])
            middleware = CancelOnDisconnectMiddleware(app, registry=self.registry)
            await asyncio.wait_for(conn.run(middleware, scope), NODE_WATCHDOG)
            return conn

        return asyncio.run_coroutine_threadsafe(serve(), self.loop)

    def wait_registered(self, request_id: str) -> None:
        deadline = time.monotonic() + NODE_WATCHDOG
        while request_id not in self.registry:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def acancel(self, request_id: str) -> tuple[bool, float]:
        started = time.perf_counter()
        held = self.run(self.registry.acancel(request_id))
        return held, time.perf_counter() - started

    def endpoint_cancel(self, request_id: str) -> tuple[int | None, object]:
        """DELETE /{id} on this process's cancel endpoint: (status, the JSON answer)."""

        async def ask() -> tuple[int | None, object]:
            conn = ClientConnection()
            endpoint = cancel_endpoint(self.registry, authorize=None)
            await asyncio.wait_for(conn.run(endpoint, http_scope("DELETE", f"/{request_id}")), 5)
            return conn.status, json.loads(conn.body)

        return self.run(ask())  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.broker is not None:
            self.run(self.broker.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(NODE_WATCHDOG)
        self.loop.close()
