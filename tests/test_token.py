"""CancelToken, current_token() and their reach into threads and callbacks."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .helpers import (
    read_body,
    respond,
    run_capturing,
    until,
    with_watchdog,
)

pytestmark = pytest.mark.anyio


def test_current_token_outside_a_request_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="outside a request handled by CancelOnDisconnect"):
        current_token()


async def test_token_seen_by_sync_code_in_a_worker_thread() -> None:
    """A FastAPI `def` endpoint runs in the threadpool with a copy of the context."""
    events: list[str] = []
    started = threading.Event()

    def blocking_work() -> str:
        token = current_token()
        started.set()
        for _ in range(500):  # bounded: 5 s at most
            try:
                token.raise_if_cancelled()
            except asyncio.CancelledError as exc:
                events.append(f"thread stopped: {exc}")
                raise
            time.sleep(0.01)
        return "done"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await asyncio.to_thread(blocking_work)
        except asyncio.CancelledError:
            events.append("app cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(started.is_set)
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    await until(lambda: len(events) == 2)
    assert sorted(events) == ["app cancelled", "thread stopped: client disconnected"]


async def test_wait_on_cancel_and_unregister() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        assert not token.cancelled
        assert token.reason is None
        token.on_cancel(lambda: events.append("callback"))
        unregister = token.on_cancel(lambda: events.append("unregistered callback"))
        unregister()
        unregister()  # twice is harmless

        async def waiter() -> None:
            await token.wait()
            events.append("waiter woke")

        await read_body(receive)
        waiter_task = asyncio.create_task(waiter())
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("app cancelled")
            await asyncio.wait_for(waiter_task, 1)
            token.on_cancel(lambda: events.append("late callback runs at once"))
            await token.wait()  # returns at once
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["callback", "waiter woke", "app cancelled", "late callback runs at once"]


async def test_awaitable_callback_completes_even_while_app_is_cancelled() -> None:
    """An engine abort returned by a callback finishes before the request ends."""
    events: list[str] = []

    async def abort() -> None:
        await asyncio.sleep(0.05)
        events.append("abort finished")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        current_token().on_cancel(abort)
        await read_body(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("app cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["app cancelled", "abort finished"]


async def test_failing_callback_is_logged_and_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []

    def broken() -> None:
        raise ZeroDivisionError

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        current_token().on_cancel(broken)
        current_token().on_cancel(lambda: events.append("second callback"))
        await read_body(receive)
        await asyncio.sleep(30)

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["second callback"]
    assert any("on_cancel callback" in r.getMessage() for r in caplog.records)


async def test_each_request_has_its_own_token() -> None:
    tokens: list[CancelToken] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        tokens.append(current_token())
        await respond(send)

    middleware = CancelOnDisconnectMiddleware(app)
    for _ in range(2):
        await with_watchdog(ClientConnection().run(middleware))
    assert len(tokens) == 2
    assert tokens[0] is not tokens[1]
    assert repr(tokens[0]) == "<CancelToken active>"


def test_on_cancel_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="callback must be callable"):
        CancelToken().on_cancel("nope")  # type: ignore[arg-type]


def test_standalone_token_fires() -> None:
    token = CancelToken()
    seen: list[str] = []
    token.on_cancel(lambda: seen.append("cb"))
    token.fire("test")
    token.fire("again")  # once only
    assert token.cancelled
    assert token.reason == "test"
    assert seen == ["cb"]
    with pytest.raises(asyncio.CancelledError, match="test"):
        token.raise_if_cancelled()
    assert repr(token) == "<CancelToken cancelled, reason='test'>"


async def test_shield_exit_then_dropped_response_does_not_leak_a_cancel_to_the_server() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        token = current_token()
        with shield():
            await until(lambda: token.cancelled)  # a commit that spans the disconnect
        await respond(send)  # the client is gone: both sends are dropped, neither suspends

    conn = ClientConnection()

    async def server_task() -> str:
        try:
            await CancelOnDisconnectMiddleware(app)(http_scope(), conn.receive, conn.send)
        except asyncio.CancelledError:
            return "CancelledError escaped __call__"
        try:
            await asyncio.sleep(0)  # the server carries on in the same task (hypercorn: send(None))
        except asyncio.CancelledError:
            return "a pending cancel leaked into the server's task"
        return "server carried on"

    task = asyncio.create_task(server_task())
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    assert await with_watchdog(task) == "server carried on"


async def test_callback_raising_cancelled_error_still_cancels_the_app() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        token.on_cancel(token.raise_if_cancelled)  # a sync check reused as a callback
        current_token().on_cancel(lambda: events.append("second callback"))
        await read_body(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task, 1.0)
    assert events == ["second callback", "cancelled"]


async def test_callback_unregistered_by_an_earlier_callback_does_not_run() -> None:
    calls: list[str] = []
    unregister: list[Callable[[], None]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()

        def first() -> None:
            calls.append("first")
            unregister[0]()  # e.g. the other `abort_on_cancel` block already exited

        token.on_cancel(first)
        unregister.append(token.on_cancel(lambda: calls.append("second")))
        await read_body(receive)
        await asyncio.sleep(30)

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert calls == ["first"]


_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def correlation_id_middleware(app: ASGIApp) -> ASGIApp:
    """Like asgi-correlation-id: an outer middleware binds a per-request contextvar."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        _request_id.set(scope["path"])
        await app(scope, receive, send)

    return wrapped


async def test_callbacks_run_in_their_own_requests_context() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()

        def callback() -> None:
            try:
                same = current_token() is token
            except RuntimeError:
                same = False
            seen.append(f"{scope['path']}: request_id={_request_id.get()} token={same}")

        token.on_cancel(callback)
        await read_body(receive)
        await asyncio.sleep(30 if scope["path"] == "/two" else 0.01)
        await respond(send)

    middleware = correlation_id_middleware(CancelOnDisconnectMiddleware(app))
    one, two = ClientConnection(), ClientConnection()
    # Two requests that start in the same event-loop iteration (one batch of watchers).
    tasks = [
        asyncio.create_task(one.run(middleware, http_scope(path="/one"))),
        asyncio.create_task(two.run(middleware, http_scope(path="/two"))),
    ]
    await until(lambda: two.receive_calls >= 2)
    two.disconnect()
    await with_watchdog(asyncio.gather(*tasks))
    assert seen == ["/two: request_id=/two token=True"]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_failing_async_callback_is_logged_not_raised(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def failing_abort() -> None:
        await anyio.lowlevel.checkpoint()
        raise ValueError("abort failed")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        current_token().on_cancel(failing_abort)
        await read_body(receive)
        await anyio.sleep(30)

    conn = ClientConnection()
    escaped: list[BaseException | None] = []

    async def run() -> None:
        escaped.append(
            await run_capturing(CancelOnDisconnectMiddleware(app), conn.receive, conn.send)
        )

    with caplog.at_level(logging.ERROR, logger="asgi_cancel"), anyio.fail_after(5):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run)
            while conn.receive_calls < 2:  # noqa: ASYNC110 (polling a plain counter)
                await anyio.sleep(0.001)
            conn.disconnect()
    assert escaped == [None]
    assert any("on_cancel task failed" in r.getMessage() for r in caplog.records)


async def test_token_made_on_first_use_is_one_token_across_threads() -> None:
    """The token is made on first use: threads asking for it at the same moment all get the
    one token that the disconnect fires (not one each, of which only one would fire)."""
    threads = 8
    barrier = threading.Barrier(threads)
    seen: list[CancelToken] = []

    def ask() -> None:
        barrier.wait(timeout=5)
        seen.append(current_token())

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        context = contextvars.copy_context()
        workers = [threading.Thread(target=context.copy().run, args=(ask,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            await anyio.to_thread.run_sync(worker.join, 5)
        await anyio.sleep(30)

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app, watch_delay=0)))
    await until(lambda: len(seen) == threads)
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert len({id(token) for token in seen}) == 1
    assert seen[0].cancelled
    assert seen[0].reason == "client disconnected"
