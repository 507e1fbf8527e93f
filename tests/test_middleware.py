"""The contract (DESIGN.md lines 1-9), driven at the ASGI level with hand-written servers."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Message, Receive, Scope, Send

from .helpers import (
    QueueServer,
    read_body,
    receive_once,
    respond,
    run_capturing,
    slow_app,
    streaming_app,
    until,
    with_watchdog,
)

pytestmark = pytest.mark.anyio

CANCELLED_RESPONSE = [
    {"type": "http.response.start", "status": 499, "headers": []},
    {"type": "http.response.body", "body": b"", "more_body": False},
]


# -- 1. only http scopes ------------------------------------------------------------------------
@pytest.mark.parametrize("scope_type", ["websocket", "lifespan"])
async def test_non_http_scopes_pass_through_untouched(scope_type: str) -> None:
    seen: list[tuple[Scope, Receive, Send]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope, receive, send))

    async def receive() -> Message:
        raise AssertionError("not called")

    async def send(message: Message) -> None:
        raise AssertionError("not called")

    scope: Scope = {"type": scope_type}
    await with_watchdog(CancelOnDisconnectMiddleware(app)(scope, receive, send))
    assert seen == [(scope, receive, send)]


# -- 2. body integrity --------------------------------------------------------------------------
CHUNKS = [b"a" * 10, b"b" * 7, b"", b"c" * 3000, b"d"]


@pytest.mark.parametrize("read_ahead", [0, 5, 64 * 1024], ids=["no-read-ahead", "tiny", "default"])
@pytest.mark.parametrize("when", ["at-once", "late"])
async def test_body_reaches_app_unchanged_in_order(read_ahead: int, when: str) -> None:
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if when == "late":
            await asyncio.sleep(0.02)  # the watcher has started and read ahead by now
        while True:
            message = await receive()
            received.append(message)
            if not message.get("more_body", False):
                break
        await respond(send)

    conn = ClientConnection(CHUNKS)
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=read_ahead)
    await with_watchdog(conn.run(middleware, http_scope("POST")))
    assert [m["body"] for m in received] == CHUNKS
    assert [m["more_body"] for m in received] == [True] * 4 + [False]
    assert conn.body == b"ok"


async def test_body_never_read_by_app_is_fine() -> None:
    events: list[str] = []
    conn = ClientConnection([b"x" * 100, b"y"])
    middleware = CancelOnDisconnectMiddleware(slow_app(events, seconds=0.02, read=False))
    await with_watchdog(conn.run(middleware, http_scope("POST")))
    assert events == ["finished"]


async def test_read_ahead_is_bounded_then_server_backpressure() -> None:
    """With read_ahead=10 the middleware holds at most one chunk past the limit."""
    server = QueueServer(*({"type": "http.request", "body": b"x" * 8, "more_body": True},) * 50)
    started = asyncio.Event()
    release = asyncio.Event()
    got: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        started.set()
        await release.wait()
        for _ in range(50):
            got.append((await receive())["body"])
        await respond(send)

    middleware = CancelOnDisconnectMiddleware(app, read_ahead=10, watch_delay=0)
    task = asyncio.create_task(middleware(http_scope("POST"), server.receive, server.send))
    await with_watchdog(started.wait())
    for _ in range(20):
        await asyncio.sleep(0)
    # 8 bytes buffered (< 10), the second chunk makes 16 >= 10: reading stops there.
    assert server.receive_calls == 2
    release.set()
    await until(lambda: len(got) == 50)
    assert got == [b"x" * 8] * 50
    await with_watchdog(task)
    assert server.receive_calls == 50  # every chunk read from the server exactly once


async def test_extra_empty_request_after_body_is_ignored() -> None:
    server = QueueServer(
        {"type": "http.request", "body": b"abc", "more_body": False},
        {"type": "http.request", "body": b"", "more_body": False},
    )
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(0.01)  # let the watcher read both
        received.append(await receive())
        listener = asyncio.create_task(receive_once(receive))
        await asyncio.sleep(0.01)
        server.disconnect()
        received.append(await asyncio.wait_for(listener, 2))
        await respond(send)

    await with_watchdog(
        CancelOnDisconnectMiddleware(app)(http_scope(), server.receive, server.send)
    )
    assert received == [
        {"type": "http.request", "body": b"abc", "more_body": False},
        {"type": "http.disconnect"},
    ]


async def test_disconnect_mid_body_cancels_without_error_or_loss() -> None:
    got: list[bytes] = []
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            while True:
                message = await receive()
                assert message["type"] == "http.request"
                got.append(message["body"])
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection([b"1", b"2", b"3", b"4"], body_delay=0.01)
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app), http_scope("POST")))
    await until(lambda: len(got) == 2)
    conn.disconnect()
    await with_watchdog(task)  # returns normally: no exception reaches the server
    assert got == [b"1", b"2"]
    assert events == ["cancelled"]
    assert conn.sent == []


# -- 3. the only caller of receive; replay ------------------------------------------------------
async def test_disconnect_replayed_to_concurrent_and_repeat_callers() -> None:
    """hypercorn/daphne deliver one disconnect then block: every app caller still gets it."""
    results: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        listeners = [asyncio.create_task(receive_once(receive)) for _ in range(2)]
        await asyncio.sleep(0.01)
        conn.disconnect()
        results.extend(await asyncio.gather(*listeners))
        for _ in range(3):
            results.append(await receive())
        raise RuntimeError("after disconnect")  # app errors still propagate unchanged

    conn = ClientConnection(b"body", after_disconnect="block")
    with pytest.raises(RuntimeError, match="after disconnect"):
        await with_watchdog(conn.run(CancelOnDisconnectMiddleware(app, grace=5)))
    assert results == [{"type": "http.disconnect"}] * 5


async def test_server_receive_not_called_after_disconnect() -> None:
    events: list[str] = []
    server = QueueServer({"type": "http.request", "body": b"", "more_body": False})
    task = asyncio.create_task(
        CancelOnDisconnectMiddleware(slow_app(events))(http_scope(), server.receive, server.send)
    )
    await until(lambda: server.receive_calls == 2)  # the body, then waiting for the disconnect
    server.disconnect()
    await with_watchdog(task)
    assert events == ["body:", "cancelled"]
    assert server.receive_calls == 2


# -- 4/5. cancellation: prompt, once, not after the response ------------------------------------
async def test_disconnect_cancels_app_within_one_loop_iteration() -> None:
    events: list[str] = []
    conn = ClientConnection(b"", after_disconnect="replay")
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(slow_app(events))))
    await until(lambda: conn.receive_calls >= 2)  # the watcher is waiting for the disconnect
    conn.disconnect()
    for _ in range(3):  # event set -> watcher resumes -> app task resumes with CancelledError
        await asyncio.sleep(0)
    assert events == ["body:", "cancelled"]
    await with_watchdog(task)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_streaming_app_cancelled_and_sends_dropped(spec_version: str) -> None:
    events: list[str] = []
    conn = ClientConnection()
    task = asyncio.create_task(
        conn.run(
            CancelOnDisconnectMiddleware(streaming_app(events)),
            http_scope(spec_version=spec_version),
        )
    )
    await with_watchdog(conn.wait_for_body_chunks(3))
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["cancelled"]
    assert not conn.response_complete


async def test_cleanup_after_cancel_is_edge_triggered() -> None:
    """`except CancelledError: await cleanup()` and `finally:` run to completion."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            for _ in range(3):
                await asyncio.sleep(0.01)  # an engine abort: must not be cancelled again
            events.append("abort done")
            raise
        finally:
            await asyncio.sleep(0.01)
            events.append("finally done")

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["abort done", "finally done"]


async def test_disconnect_after_response_cancels_nothing() -> None:
    """Every h1 server sends http.disconnect right after a normal response."""
    events: list[str] = []
    sends_returned = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send)
        sends_returned.set()
        try:
            await asyncio.sleep(0.05)  # background work after the response
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("background done")
        events.append(f"token cancelled={current_token().cancelled}")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            conn.disconnect()  # hypercorn-trio: the disconnect arrives before send() returns
            await asyncio.sleep(0.01)
        await conn.send(message)

    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(app)
    await with_watchdog(middleware(http_scope(), conn.receive, send))
    assert events == ["background done", "token cancelled=False"]


async def test_outside_cancellation_propagates() -> None:
    events: list[str] = []
    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(slow_app(events))))
    await until(lambda: conn.receive_calls >= 2)
    task.cancel()  # server shutdown
    with pytest.raises(asyncio.CancelledError):
        await with_watchdog(task)
    assert events == ["body:", "cancelled"]
    assert not current_token_set()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.uncancel() needs Python 3.11")
async def test_outside_cancellation_during_our_cancellation_propagates() -> None:
    started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            started.set()
            await asyncio.sleep(0.05)
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(started.wait())
    task.cancel()  # the server shuts down while the app cleans up
    with pytest.raises(asyncio.CancelledError):
        await with_watchdog(task)


async def test_app_exception_propagates_unchanged() -> None:
    error = ValueError("boom")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(0.01)
        raise error

    conn = ClientConnection()
    with pytest.raises(ValueError, match="boom") as info:
        await with_watchdog(conn.run(CancelOnDisconnectMiddleware(app)))
    assert info.value is error


# -- 6. nothing left behind ---------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["fast", "slow-normal", "cancelled", "listening"])
async def test_no_task_outlives_the_request(scenario: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scenario == "listening":
            await read_body(receive)
            await receive()
            return
        if scenario != "fast":
            await asyncio.sleep(0.02 if scenario == "slow-normal" else 30)
        await respond(send)

    before = asyncio.all_tasks()
    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    if scenario in ("cancelled", "listening"):
        await until(lambda: conn.receive_calls >= 2)
        conn.disconnect()
    await with_watchdog(task)
    assert asyncio.all_tasks() == before


async def test_fast_request_creates_no_task() -> None:
    created: list[object] = []
    loop = asyncio.get_running_loop()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await respond(send)

    server = QueueServer({"type": "http.request", "body": b"hi", "more_body": False})
    middleware = CancelOnDisconnectMiddleware(app)
    loop.set_task_factory(factory)
    try:
        await middleware(http_scope("POST"), server.receive, server.send)
    finally:
        loop.set_task_factory(None)
    assert created == []
    assert [m["type"] for m in server.sent] == ["http.response.start", "http.response.body"]


# -- 7. sends dropped after disconnect ----------------------------------------------------------
async def test_send_after_disconnect_never_reaches_a_server_that_would_hang() -> None:
    """hypercorn h2 after the TCP connection closed: a body send() hangs forever.

    The app's late response is dropped; the middleware's own 499 (for an outer middleware
    that waits for a response) is only a response start over HTTP/2, which returns there.
    """
    calls: list[Message] = []
    server = QueueServer({"type": "http.request", "body": b"", "more_body": False})

    async def hanging_send(message: Message) -> None:
        calls.append(message)
        if message["type"] != "http.response.start" and server.receive_calls > 1:
            await asyncio.Event().wait()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await receive()  # waits for the disconnect itself, then sends anyway
        await respond(send, b"too late")

    scope = http_scope()
    scope["http_version"] = "2"
    task = asyncio.create_task(
        CancelOnDisconnectMiddleware(app)(scope, server.receive, hanging_send)
    )
    await until(lambda: server.receive_calls >= 2)
    server.disconnect()
    await with_watchdog(task)
    assert calls == [{"type": "http.response.start", "status": 499, "headers": []}]


async def test_request_cancelled_before_its_response_is_completed_with_a_499() -> None:
    """HTTP/1.1: start and an empty final body, both dropped by a server whose client left."""
    events: list[str] = []
    server = QueueServer({"type": "http.request", "body": b"", "more_body": False})
    task = asyncio.create_task(
        CancelOnDisconnectMiddleware(slow_app(events))(http_scope(), server.receive, server.send)
    )
    await until(lambda: server.receive_calls >= 2)
    server.disconnect()
    await with_watchdog(task)
    assert events == ["body:", "cancelled"]
    assert server.sent == CANCELLED_RESPONSE


# -- 8. shield ----------------------------------------------------------------------------------
async def test_shield_defers_cancellation_but_token_reports_at_once() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        try:
            with shield():
                await until(lambda: token.cancelled)
                events.append(f"in shield, reason={token.reason}")
                await asyncio.sleep(0.02)
                events.append("critical section done")
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["in shield, reason=client disconnected", "critical section done", "cancelled"]


async def test_shield_outside_a_request_does_nothing() -> None:
    with shield() as token:
        await asyncio.sleep(0)
    assert token is None


# -- 9. an app that listens itself --------------------------------------------------------------
async def test_listening_app_gets_disconnect_first_and_nothing_is_orphaned() -> None:
    """vLLM's with_cancellation: handler task + listener task + asyncio.wait."""
    events: list[str] = []

    async def handler() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("inner handler cancelled")
            raise
        return "result"

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            events.append("listener got disconnect")

        handler_task = asyncio.create_task(handler())
        listener = asyncio.create_task(listen())
        _done, pending = await asyncio.wait(
            [handler_task, listener], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        await asyncio.sleep(0.01)
        events.append("outer returned")
        await respond(send, b"null")  # FastAPI would serialise the None: dropped

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app, grace=1.0)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["listener got disconnect", "inner handler cancelled", "outer returned"]
    assert conn.sent == []


async def test_listening_app_that_ignores_disconnect_is_cancelled_after_grace() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        message = await receive()
        events.append(message["type"])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app, grace=0.05)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["http.disconnect", "cancelled"]


# -- observability ------------------------------------------------------------------------------
async def test_cancelled_request_logged_and_hook_called_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[dict[str, Any]] = []

    def hook(scope: Scope, **info: Any) -> None:
        calls.append({"path": scope["path"], **info})

    events: list[str] = []
    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(streaming_app(events), on_cancelled=hook)
    task = asyncio.create_task(conn.run(middleware, http_scope("POST", "/v1/completions")))
    await with_watchdog(conn.wait_for_body_chunks(2))
    with caplog.at_level(logging.INFO, logger="asgi_cancel"):
        conn.disconnect()
        await with_watchdog(task)
    assert len(calls) == 1
    call = calls[0]
    assert call["path"] == "/v1/completions"
    assert call["reason"] == "client disconnected"
    assert call["response_started"] is True
    assert 0 < call["elapsed"] < 5
    messages = [r.getMessage() for r in caplog.records if r.name == "asgi_cancel"]
    assert len(messages) == 1
    assert messages[0].startswith("POST /v1/completions cancelled after ")
    assert messages[0].endswith("s mid-stream: client disconnected (499)")
    fields = getattr(caplog.records[-1], "asgi_cancel")  # noqa: B009 (set through extra=)
    assert fields == {
        "method": "POST",
        "path": "/v1/completions",
        "route": "unmatched",  # no router in this app
        "reason": "client disconnected",
        "elapsed": fields["elapsed"],
        "response_started": True,
        "phase": "mid_stream",
        "status": 499,
        "request_id": None,
    }
    assert 0 < fields["elapsed"] < 5


async def test_normal_request_not_logged_and_hook_not_called(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[object] = []
    events: list[str] = []
    conn = ClientConnection(after_disconnect="replay")
    middleware = CancelOnDisconnectMiddleware(
        slow_app(events, seconds=0.0), on_cancelled=lambda scope, **kw: calls.append(kw)
    )
    with caplog.at_level(logging.INFO, logger="asgi_cancel"):
        await with_watchdog(conn.run(middleware))
    assert events == ["body:", "finished"]
    assert calls == []
    assert [r for r in caplog.records if r.name == "asgi_cancel"] == []


def current_token_set() -> bool:
    try:
        current_token()
    except RuntimeError:
        return False
    return True


async def test_middleware_wrapped_twice_cancels_once_and_returns_normally() -> None:
    events: list[str] = []
    tokens: list[CancelToken] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        tokens.append(current_token())
        await read_body(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            await asyncio.sleep(0.01)  # cleanup: not cancelled again by the outer middleware
            events.append("cleanup done")
            raise

    before = asyncio.all_tasks()
    conn = ClientConnection(b"x" * 100)
    doubled = CancelOnDisconnectMiddleware(CancelOnDisconnectMiddleware(app))
    task = asyncio.create_task(run_capturing(doubled, conn.receive, conn.send, http_scope("POST")))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    assert await with_watchdog(task) is None
    assert events == ["cancelled", "cleanup done"]
    assert tokens[0].cancelled
    assert asyncio.all_tasks() - before == set()
