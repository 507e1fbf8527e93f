"""One request's states (`_cycle.py`) through the middleware, on asyncio and trio: the body
(docs/contract.md line 2), the middleware as the only caller of `receive` and its replay (3), when a
disconnect cancels (4), sends dropped after it (7), apps that listen themselves (9), and what a
finished cycle lets go. Odd message orders come from hand-written servers.
"""

from __future__ import annotations

import gc
import math
import weakref
from contextlib import nullcontext
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, current_token, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Message, Receive, Scope, Send

from .helpers import (
    CANCELLED_RESPONSE,
    DISCONNECT,
    REQUEST_DONE,
    WATCHDOG,
    KeepAliveServer,
    QueueServer,
    leave,
    noting_cancellation,
    read_body,
    receive_into,
    respond,
    serving,
    slow_app,
    until,
    with_watchdog,
)

pytestmark = pytest.mark.anyio


# -- 2. the body (in order, none lost, whenever the app reads it: tests/test_properties.py) ----
async def test_read_ahead_is_bounded_then_server_backpressure() -> None:
    server = QueueServer(*({"type": "http.request", "body": b"x" * 8, "more_body": True},) * 50)
    release = anyio.Event()
    got: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        for _ in range(50):
            got.append((await receive())["body"])
        await respond(send)

    middleware = CancelOnDisconnectMiddleware(app, read_ahead=10, watch_delay=0)
    async with serving(middleware, http_scope("POST"), server.receive, server.send):
        await until(lambda: server.receive_calls >= 2)
        await anyio.sleep(0.02)  # the watcher is parked: it reads no further
        # 8 bytes buffered (< 10), the second chunk makes 16 >= 10: reading stops there.
        assert server.receive_calls == 2
        release.set()
    assert got == [b"x" * 8] * 50
    assert server.receive_calls == 50  # every chunk read from the server exactly once


@pytest.mark.parametrize("read_ahead", [0, 1, 9, 64 * 1024])
async def test_body_read_from_several_tasks_is_complete_and_in_order(read_ahead: int) -> None:
    """Three app tasks race for the body while the watcher reads ahead: no loss, no duplicate."""
    chunks = [bytes([65 + i]) * (i % 4 + 1) for i in range(30)]
    order: list[bytes] = []

    async def reader(receive: Receive, pause: float, group: anyio.abc.TaskGroup) -> None:
        while True:
            message = await receive()
            assert message["type"] == "http.request", message
            order.append(message["body"])
            if not message.get("more_body", False):
                group.cancel_scope.cancel()  # the others are parked (or reading): safe
            await anyio.sleep(pause)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(0.003)  # the watcher has started and read ahead
        async with anyio.create_task_group() as group:
            for pause in (0, 0.0005, 0.001):
                group.start_soon(reader, receive, pause, group)
        await respond(send)

    server = QueueServer()
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=read_ahead)
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(server.feed, chunks, 0.0003)
            await middleware(http_scope("POST"), server.receive, server.send)
    assert order == chunks


@pytest.mark.parametrize("read_ahead", [0, 4, 64 * 1024])
async def test_app_receive_timing_out_repeatedly_loses_nothing(read_ahead: int) -> None:
    """`receive()` under a tiny timeout cancels parked/reading callers over and over: no loss."""
    chunks = [b"aa", b"bbb", b"c", b"dddd"]
    got: list[Message] = []
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with noting_cancellation(events):
            while not got or got[-1]["type"] == "http.request":
                with anyio.move_on_after(0.001):
                    got.append(await receive())
        events.append("app saw the disconnect")
        await anyio.sleep(30)  # ignores it: cancelled after the grace period

    server = QueueServer()
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=read_ahead, grace=0.02)
    async with serving(middleware, http_scope("POST"), server.receive, server.send):
        await server.feed(chunks, 0.004)
        await until(lambda: len(got) == len(chunks))
        await anyio.sleep(0.01)
        server.disconnect()
    assert [m.get("body") for m in got[:4]] == chunks
    # Either the app's receive() got the disconnect (listening: grace, then cancel) or the
    # watcher got it while no receive() was pending (cancelled at once). Never a duplicate.
    assert got[4:] in ([DISCONNECT], [])
    assert events in (["app saw the disconnect"], ["cancelled"])


@pytest.mark.parametrize("read_ahead", [0, 64 * 1024], ids=["no-read-ahead", "read-ahead"])
async def test_disconnect_mid_body_cancels_the_body_reader_without_error_or_loss(
    read_ahead: int,
) -> None:
    """The cancellation lands in the app's receive(): the disconnect is returned to nobody, so
    a Starlette app does not turn it into ClientDisconnect / a 400."""
    got: list[Message] = []
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with noting_cancellation(events):
            while True:
                got.append(await receive())

    conn = ClientConnection([b"1", b"2", b"3", b"4"], body_delay=0.01)
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=read_ahead)
    await leave(middleware, conn, http_scope("POST"), when=lambda: len(got) == 2)
    assert conn.app_exception is None  # returns normally: no exception reaches the server
    assert got == [{"type": "http.request", "body": b, "more_body": True} for b in (b"1", b"2")]
    assert events == ["cancelled"]
    assert conn.sent == []


async def test_no_body_the_client_sends_after_a_stop_reaches_the_app() -> None:
    """Stopped by id mid-upload, inside `shield()` (so the app reads on): it gets
    http.disconnect, and so does every later receive(), even once the client has sent more
    (the watcher still waited for it)."""
    from asgi_cancel import CancelRegistry

    registry = CancelRegistry()
    seen: list[str] = []
    reading = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((await receive())["type"])
        with shield():
            await anyio.sleep(0.02)  # the watcher starts, and waits for the next chunk
            seen.append((await receive())["type"])  # behind the watcher, until the stop
            reading.set()
            await anyio.sleep(0.05)  # the client sends its next chunk meanwhile
            seen.append((await receive())["type"])

    server = QueueServer({"type": "http.request", "body": b"1", "more_body": True})
    middleware = CancelOnDisconnectMiddleware(app, registry=registry, watch_delay=0)
    scope = http_scope("POST", headers=[(b"x-request-id", b"upload-1")])
    async with serving(middleware, scope, server.receive, server.send):
        await until(lambda: server.receive_calls >= 2)  # the watcher waits for more body
        await anyio.sleep(0.04)  # the app waits behind it
        assert registry.cancel("upload-1")
        await reading.wait()
        server.put({"type": "http.request", "body": b"2", "more_body": True})
    assert seen == ["http.request", "http.disconnect", "http.disconnect"]


async def test_body_reader_woken_with_the_last_chunk_is_not_taken_for_a_listener() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with noting_cancellation(events):
            first = await receive()
            await anyio.sleep(0.003)  # the watcher starts and takes the server's receive
            body = first["body"] + await read_body(receive)  # parks behind the watcher
            events.append(f"body={body.decode()}")
            await anyio.sleep(30)  # starts the expensive work

    server = QueueServer({"type": "http.request", "body": b"a", "more_body": True})
    middleware = CancelOnDisconnectMiddleware(app, grace=5)
    with anyio.fail_after(1.0):  # cancelled at once, not after the 5 s grace
        async with serving(middleware, http_scope("POST"), server.receive, server.send):
            await until(lambda: server.receive_calls >= 2)  # the watcher waits; the app parks
            await anyio.sleep(0.005)
            # The client sends its last chunk and closes at once: both arrive together.
            server.put({"type": "http.request", "body": b"b", "more_body": False})
            server.disconnect()
    # The cancellation lands in the body read (the reader was handed "b" but had not resumed
    # yet) or just after it: either way at once, not after a listener's grace.
    assert events in (["body=ab", "cancelled"], ["cancelled"])


# -- 3. the only caller of receive; replay ------------------------------------------------------
async def test_disconnect_replayed_to_concurrent_and_repeat_callers() -> None:
    """hypercorn/daphne deliver one disconnect then block: every app caller still gets it. An
    extra empty http.request after the body (read ahead by the watcher) reaches none of them."""
    body: Message = {"type": "http.request", "body": b"abc", "more_body": False}
    server = QueueServer(body, REQUEST_DONE)  # then it blocks, like hypercorn/daphne
    results: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(0.01)  # let the watcher read both
        results.append(await receive())
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(receive_into, results, receive)
            await anyio.sleep(0.01)
            server.disconnect()
        for _ in range(3):
            results.append(await receive())
        raise RuntimeError("after disconnect")  # app errors still propagate unchanged

    middleware = CancelOnDisconnectMiddleware(app, grace=5)
    with pytest.raises(RuntimeError, match="after disconnect"):
        await with_watchdog(middleware(http_scope(), server.receive, server.send))
    assert results == [body, *[DISCONNECT] * 5]


async def test_starlette_is_disconnected_polling_sees_the_cached_disconnect() -> None:
    """`Request.is_disconnected()` calls receive() in a pre-cancelled anyio scope."""
    from starlette.requests import Request

    events: list[str] = []
    polls: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        await request.body()
        with noting_cancellation(events):
            with shield():
                while not await request.is_disconnected():
                    polls.append(True)
                    await anyio.sleep(0.002)
                events.append("saw the disconnect")
                await anyio.sleep(0.01)  # still shielded: finish the unit of work
            await anyio.sleep(30)

    conn = ClientConnection(b"payload", after_disconnect="block")  # hypercorn/daphne
    await leave(
        CancelOnDisconnectMiddleware(app), conn, http_scope("POST"), when=lambda: bool(polls)
    )
    assert events == ["saw the disconnect", "cancelled"]


class ServerGone(Exception):
    """What a server's receive() might raise (not an OSError: TimeoutError is one)."""


@pytest.mark.parametrize("server", ["raises", "repeats-empty-requests"])
async def test_the_watcher_giving_up_does_not_strand_a_parked_app_receive(server: str) -> None:
    """The watcher stops at a server receive() that raises (the app meets the same error on
    its own receive: the comment in watch()) or that answers every call after the body with an
    empty http.request; an app receive() parked behind it is woken and reads itself."""
    calls = 0

    async def receive() -> Message:
        nonlocal calls
        calls += 1
        if calls > 1 and server == "raises":
            await anyio.sleep(max(0.0, fails_at - anyio.current_time()))  # the app parks
            raise ServerGone("connection reset")
        if calls > 1:
            await anyio.sleep(0.002)
        return dict(REQUEST_DONE)

    got: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await anyio.sleep(0.005)  # the watcher now holds the server's receive
        try:
            got.append((await receive())["type"])  # parks behind the watcher
        except ServerGone as exc:
            got.append(str(exc))
            raise
        await respond(send)

    fails_at = anyio.current_time() + 0.02
    middleware = CancelOnDisconnectMiddleware(app, watch_delay=0)
    with anyio.fail_after(1.0), pytest.raises(ServerGone) if server == "raises" else nullcontext():
        await middleware(http_scope(), receive, QueueServer().send)
    assert got == (["connection reset"] if server == "raises" else ["http.request"])


# -- 4. when a disconnect cancels ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("queued", "read", "read_ahead"),
    [(False, True, 65536), (True, False, 65536), (False, False, 0)],
    ids=["while-it-runs", "before-it-starts", "never-read-without-read-ahead"],
)
async def test_disconnect_cancels_the_app_at_once_and_completes_a_499(
    queued: bool, read: bool, read_ahead: int
) -> None:
    """The app does not listen: cancelled at the disconnect, not after a listener's grace; the
    server's receive never called again (hypercorn would block); the response completed for
    outer middlewares (HTTP/1.1: dropped by a server whose client left)."""
    events: list[str] = []
    server = QueueServer({"type": "http.request", "body": b"abc", "more_body": False})
    if queued:
        server.disconnect()
    app = slow_app(events, read=read)
    middleware = CancelOnDisconnectMiddleware(app, grace=30, read_ahead=read_ahead)
    async with serving(middleware, http_scope("POST"), server.receive, server.send):
        await until(lambda: server.receive_calls == 2)  # the body, then the disconnect's
        if not queued:
            server.disconnect()
        with anyio.fail_after(1.0):
            await until(lambda: "cancelled" in events)
    assert events == (["body:abc", "cancelled"] if read else ["cancelled"])
    assert server.receive_calls == 2
    assert server.sent == CANCELLED_RESPONSE


@pytest.mark.parametrize("when", ["before-trailers", "after-trailers"])
async def test_trailers_keep_the_response_open_until_the_last_trailer(when: str) -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [], "trailers": True})
        await send({"type": "http.response.body", "body": b"data", "more_body": False})
        with noting_cancellation(events):
            if when == "after-trailers":
                await send(
                    {"type": "http.response.trailers", "headers": [], "more_trailers": False}
                )
            await anyio.sleep(0.1)  # the client leaves meanwhile
            if when == "before-trailers":
                await send({"type": "http.response.trailers", "headers": []})
        events.append("done")

    conn = ClientConnection(disconnect_after_response=False)
    await leave(
        CancelOnDisconnectMiddleware(app),
        conn,
        when=lambda: conn.receive_calls >= 2 and len(conn.sent) >= 2,
    )
    assert events == (["cancelled"] if when == "before-trailers" else ["done"])


async def test_receive_after_the_response_gets_the_disconnect_and_cancels_nothing() -> None:
    """Every h1 server sends http.disconnect after the response: a receive() pending across
    the final send, and one from a task that outlives the request (it must not block:
    hypercorn delivers the disconnect once), both get it; nothing is cancelled."""
    seen: list[str] = []
    received: list[Message] = []

    async def receive_later(receive: Receive) -> None:
        await anyio.sleep(0.1)  # the request is over by now
        with anyio.fail_after(1):
            message = await receive()
        seen.append(f"late {message['type']}, cancelled={current_token().cancelled}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        server.start_soon(receive_later, receive)  # in the server's task group: outlives it
        async with anyio.create_task_group() as group:
            group.start_soon(receive_into, received, receive)
            await anyio.sleep(0.01)
            await respond(send)
        with noting_cancellation(seen):
            await anyio.sleep(0.05)  # post-response work
        seen.append(f"pending {received[0]['type']}, cancelled={current_token().cancelled}")

    conn = ClientConnection(after_disconnect="block")
    async with anyio.create_task_group() as server:
        await with_watchdog(conn.run(CancelOnDisconnectMiddleware(app, grace=0.01)))
    assert seen == [
        "pending http.disconnect, cancelled=False",
        "late http.disconnect, cancelled=False",
    ]


GRACE = 0.05


@pytest.mark.parametrize(
    "returns_after", [None, GRACE / 5, 0], ids=["never-returns", "returns-within-grace", "returns"]
)
async def test_disconnect_during_the_final_send(returns_after: float | None) -> None:
    """A final send that never returns (hypercorn over HTTP/2 once the connection closed with
    data still buffered: tests/servers/test_h2.py) is cancelled `grace` after the disconnect;
    one that returns (hypercorn on trio delivers the end-of-response disconnect before its
    send returns) is the normal end: nothing is cancelled, work after the response runs on."""
    events: list[Any] = []
    reports: list[tuple[str, bool]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await send({"type": "http.response.body", "body": b"done"})
        except BaseException as exc:
            events.append(("send raised", type(exc).__name__, current_token().reason))
            raise
        events.append("send returned")
        await anyio.sleep(2 * GRACE)  # post-response work (Starlette's BackgroundTasks)
        events.append(("work done", current_token().cancelled))

    middleware = CancelOnDisconnectMiddleware(
        app,
        grace=GRACE,
        on_cancelled=lambda request: reports.append((request.reason, request.response_started)),
    )
    conn = ClientConnection(disconnect_after_response=False)

    async def send(message: Message) -> None:  # the client leaves while the final body waits
        await conn.send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            conn.disconnect()
            await anyio.sleep(math.inf if returns_after is None else returns_after)

    await with_watchdog(middleware(http_scope(), conn.receive, send))
    assert conn.body == b"done"  # handed to the server (it never reached a client that left)
    if returns_after is None:
        cancelled = anyio.get_cancelled_exc_class().__name__
        assert events == [("send raised", cancelled, "client disconnected")]
        assert reports == [("client disconnected", True)]
    else:
        assert events == ["send returned", ("work done", False)]
        assert reports == []


# -- 7. sends dropped after the disconnect ------------------------------------------------------
async def test_send_after_disconnect_never_reaches_a_server_that_would_hang() -> None:
    """hypercorn h2 after the TCP connection closed: a body send() hangs forever. The app's late
    response is dropped; the middleware's 499 is only a response start over HTTP/2."""
    calls: list[Message] = []
    server = QueueServer(REQUEST_DONE)

    async def hanging_send(message: Message) -> None:
        calls.append(message)
        if message["type"] != "http.response.start" and server.receive_calls > 1:
            await anyio.sleep_forever()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await receive()  # waits for the disconnect itself, then sends anyway
        await respond(send, b"too late")

    scope = http_scope(http_version="2")
    async with serving(CancelOnDisconnectMiddleware(app), scope, server.receive, hanging_send):
        await until(lambda: server.receive_calls >= 2)
        server.disconnect()
    assert calls == [{"type": "http.response.start", "status": 499, "headers": []}]


# -- 9. an app that listens itself --------------------------------------------------------------
async def test_listening_app_that_ignores_disconnect_is_cancelled_after_grace() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        message = await receive()
        events.append(message["type"])
        with noting_cancellation(events):
            await anyio.sleep(30)

    await leave(CancelOnDisconnectMiddleware(app, grace=0.05))
    assert events == ["http.disconnect", "cancelled"]


# -- a finished cycle ---------------------------------------------------------------------------
@pytest.mark.parametrize("awaits", [False, True], ids=["never-awaits", "awaits"])
async def test_a_context_copied_in_the_final_send_keeps_nothing_of_the_server(awaits: bool) -> None:
    """The context variable holds the cycle, and a server may copy the request's context in
    its final send: the finished cycle must not hold the server's receive/send, or the
    server's per-request objects live on in a reference cycle (10x the generation-0
    collections under uvicorn with keep-alive)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if awaits:
            await anyio.lowlevel.checkpoint()
        await respond(send)

    server = KeepAliveServer()
    kept = server.kept
    alive = weakref.ref(server)
    middleware = CancelOnDisconnectMiddleware(app)
    gc.disable()
    try:
        await with_watchdog(middleware(http_scope(), server.receive, server.send))
        del server
        assert len(kept) == 1  # the copied context is still held...
        assert alive() is None  # ...and the server's object was freed without the GC
    finally:
        gc.enable()
