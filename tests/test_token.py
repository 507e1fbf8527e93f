"""CancelToken, current_token() and their reach into threads and callbacks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token
from asgi_cancel.testing import ClientConnection
from asgi_cancel.types import Receive, Scope, Send

from .helpers import read_body, respond, until, with_watchdog

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
