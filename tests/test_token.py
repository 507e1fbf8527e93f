"""`CancelToken`, `current_token()`, `shield()` and `detach()` (`_token.py`): their reach into
tasks, threads and callbacks, on asyncio and trio (docs/contract.md lines 8 and 11)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from contextlib import nullcontext

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token, detach, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, CancelledRequest, Receive, Scope, Send

from .helpers import cleanup_scope, leave, noting_cancellation, read_body, respond

pytestmark = pytest.mark.anyio


def test_outside_a_request_current_token_is_a_clear_error_and_shield_detach_do_nothing() -> None:
    with pytest.raises(RuntimeError, match="outside a request handled by CancelOnDisconnect"):
        current_token()
    with shield() as shielded, detach() as detached:
        assert (shielded, detached) == (None, None)


def test_standalone_token_fires_once() -> None:
    token = CancelToken()
    seen: list[str] = []
    token.on_cancel(lambda: seen.append("cb"))
    with pytest.raises(TypeError, match="callback must be callable"):
        token.on_cancel("nope")  # type: ignore[arg-type]
    token.fire("test")
    token.fire("again")  # once only
    assert token.cancelled
    assert token.reason == "test"
    assert seen == ["cb"]
    with pytest.raises(asyncio.CancelledError, match="test"):
        token.raise_if_cancelled()
    assert repr(token) == "<CancelToken cancelled, reason='test'>"


# -- callbacks and wait() -----------------------------------------------------------------------
async def test_callbacks_and_waiters_run_at_the_disconnect_before_the_cancellation() -> None:
    events: list[str] = []
    woke = anyio.Event()

    async def waiter(token: CancelToken) -> None:
        await token.wait()
        events.append("waiter woke")
        woke.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        assert not token.cancelled
        assert token.reason is None

        def first() -> None:
            events.append("callback")
            unregister_later()  # e.g. the other `abort_on_cancel` block already exited

        token.on_cancel(first)
        unregister_later = token.on_cancel(lambda: events.append("unregistered by the first"))
        unregister = token.on_cancel(lambda: events.append("unregistered callback"))
        unregister()
        unregister()  # twice is harmless
        group.start_soon(waiter, token)
        await read_body(receive)
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            with cleanup_scope():
                await woke.wait()
            events.append("app cancelled")
            token.on_cancel(lambda: events.append("late callback runs at once"))
            await token.wait()  # returns at once
            raise

    async with anyio.create_task_group() as group:
        await leave(CancelOnDisconnectMiddleware(app))
    assert events == ["callback", "waiter woke", "app cancelled", "late callback runs at once"]


async def test_awaitable_callbacks_complete_and_failing_ones_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine abort returned by a callback finishes while the app is being cancelled,
    before the request ends; a callback that fails is logged, and the others still run."""
    events: list[str] = []

    async def abort() -> None:
        await anyio.sleep(0.05)
        events.append("abort finished")

    def broken() -> None:
        raise ZeroDivisionError

    async def failing_abort() -> None:
        await anyio.lowlevel.checkpoint()
        raise ValueError("abort failed")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        token.on_cancel(broken)
        token.on_cancel(token.raise_if_cancelled)  # a sync check reused: CancelledError
        token.on_cancel(failing_abort)
        token.on_cancel(abort)
        token.on_cancel(lambda: events.append("last callback"))
        await read_body(receive)
        with noting_cancellation(events):
            await anyio.sleep(30)

    with caplog.at_level(logging.ERROR, logger="asgi_cancel"):
        with anyio.fail_after(1.0):
            conn = await leave(CancelOnDisconnectMiddleware(app))
    events.append("request ended")
    assert conn.app_exception is None
    assert events == ["last callback", "cancelled", "abort finished", "request ended"]
    messages = [record.getMessage() for record in caplog.records]
    assert sum("on_cancel callback" in message for message in messages) == 2
    assert any("on_cancel task failed" in message for message in messages)


_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def correlation_id_middleware(app: ASGIApp) -> ASGIApp:
    """Like asgi-correlation-id: an outer middleware binds a per-request contextvar."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        _request_id.set(scope["path"])
        await app(scope, receive, send)

    return wrapped


async def test_callbacks_run_in_their_own_requests_context() -> None:
    seen: list[str] = []
    tokens: dict[str, CancelToken] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = tokens[scope["path"]] = current_token()

        def callback() -> None:
            try:
                same = current_token() is token
            except RuntimeError:
                same = False
            seen.append(f"{scope['path']}: request_id={_request_id.get()} token={same}")

        token.on_cancel(callback)
        await read_body(receive)
        await anyio.sleep(30 if scope["path"] == "/two" else 0.01)
        await respond(send)

    middleware = correlation_id_middleware(CancelOnDisconnectMiddleware(app))
    one, two = ClientConnection(), ClientConnection()
    # Two requests at once.
    async with anyio.create_task_group() as group:
        group.start_soon(one.run, middleware, http_scope(path="/one"))
        await leave(middleware, two, http_scope(path="/two"))
    assert seen == ["/two: request_id=/two token=True"]
    assert tokens["/one"] is not tokens["/two"]  # each request has its own
    assert repr(tokens["/one"]) == "<CancelToken active>"


# -- worker threads -----------------------------------------------------------------------------
async def test_thread_that_checks_the_token_stops_at_its_next_check() -> None:
    """A FastAPI `def` endpoint runs in the threadpool with a copy of the context."""
    events: list[str] = []

    def blocking_work() -> None:
        token = current_token()
        events.append("thread started")
        for _ in range(500):  # bounded: 5 s at most
            try:
                token.raise_if_cancelled()
            except asyncio.CancelledError as exc:
                events.append(f"thread stopped: {exc}")
                raise
            time.sleep(0.01)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await anyio.to_thread.run_sync(blocking_work)
        except (asyncio.CancelledError, anyio.get_cancelled_exc_class()):
            events.append("app cancelled")
            raise

    started = time.monotonic()
    conn = await leave(CancelOnDisconnectMiddleware(app), when=lambda: "thread started" in events)
    assert events == ["thread started", "thread stopped: client disconnected", "app cancelled"]
    assert time.monotonic() - started < 1.0  # not the 5 s the loop would take
    assert conn.app_exception is None  # trio: asyncio's CancelledError, trio's meaning


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_thread_started_in_the_apps_first_step_gets_the_token(anyio_backend: str) -> None:
    """A thread that asks for the token before the app first waited makes the request's lane
    outside the event loop (where Python 3.12's current_task() raises)."""
    tokens: list[CancelToken] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        context = contextvars.copy_context()
        asked = asyncio.get_running_loop().run_in_executor(
            None, context.run, lambda: tokens.append(current_token())
        )
        time.sleep(0.05)  # noqa: ASYNC251 - sync work in the first step, while the thread asks
        await asked
        await respond(send)

    conn = ClientConnection()
    with anyio.fail_after(5):
        await conn.run(CancelOnDisconnectMiddleware(app), http_scope())
    assert conn.status == 200
    assert len(tokens) == 1
    assert not tokens[0].cancelled


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

    middleware = CancelOnDisconnectMiddleware(app, watch_delay=0)
    await leave(middleware, when=lambda: len(seen) == threads)
    assert len({id(token) for token in seen}) == 1
    assert seen[0].cancelled
    assert seen[0].reason == "client disconnected"


# -- 8. shield() and detach() -------------------------------------------------------------------
@pytest.mark.parametrize("first", ["shield", "thread", "shield-in-thread"])
async def test_a_shield_right_after_a_deferred_cancellation_is_not_interrupted(first: str) -> None:
    """The client leaves during a first step whose end the cancellation waits for: a `shield()`
    block (its deferred cancellation used to land inside the next one), a worker thread (found
    by tests/test_properties.py, the client leaving mid-body), or a `shield()` in a worker
    thread (a FastAPI `def` endpoint's commit). A `shield()` entered synchronously right after
    it (a second commit) still runs to its end; the cancellation lands at the next await. The
    token reports the disconnect at once, inside the first step."""
    events: list[str] = []
    conn = ClientConnection([b""], body_delay=0.2) if first == "thread" else ClientConnection()

    def in_a_thread() -> None:
        with shield() if first == "shield-in-thread" else nullcontext():
            anyio.from_thread.run_sync(conn.disconnect)  # the client leaves meanwhile
            time.sleep(0.05)
            events.append(f"first step done: {current_token().reason}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with noting_cancellation(events):
            if first == "shield":
                with shield():
                    conn.disconnect()
                    await anyio.sleep(0.05)
                    events.append(f"first step done: {current_token().reason}")
            else:
                await anyio.to_thread.run_sync(in_a_thread)
            with shield():  # e.g. `await db.commit()`
                await anyio.sleep(0.05)
                events.append("shielded step done")
            await anyio.sleep(30)

    with anyio.fail_after(5):
        await conn.run(CancelOnDisconnectMiddleware(app, watch_delay=0))
    assert conn.app_exception is None
    first_step = "first step done: client disconnected"
    assert events == [first_step, "shielded step done", "cancelled"]


async def test_detached_handler_runs_to_the_end_while_its_token_reports_the_disconnect() -> None:
    events: list[str] = []
    hook_calls: list[CancelledRequest] = []

    @detach()
    async def endpoint() -> None:
        token = current_token()
        token.on_cancel(lambda: events.append("token fired"))
        events.append("started")
        await anyio.sleep(0.2)
        with shield():  # a shield's exit inside a detached request cancels nothing either
            await anyio.lowlevel.checkpoint()
        await anyio.sleep(0.05)
        events.append(f"finished cancelled={token.cancelled} detached={token.detached}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await endpoint()
        await respond(send)

    middleware = CancelOnDisconnectMiddleware(app, on_cancelled=hook_calls.append, watch_delay=0)
    await leave(middleware, scope=http_scope("POST", "/payments"), when=lambda: events != [])
    assert events == ["started", "token fired", "finished cancelled=True detached=True"]
    assert len(hook_calls) == 1
    assert hook_calls[0].response_started is False


async def test_detach_as_a_context_manager_and_on_a_sync_function() -> None:
    events: list[str] = []

    @detach()
    def sync_part() -> bool:
        return current_token().detached

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert not current_token().detached
        with detach() as token:
            assert token is current_token()
            events.append("started")
            await anyio.sleep(0.1)
        events.append(f"sync detached={sync_part()}")
        await respond(send)

    await leave(CancelOnDisconnectMiddleware(app, watch_delay=0), when=lambda: events != [])
    assert events == ["started", "sync detached=True"]
