"""One request's states through the middleware: reading the body, watching for the disconnect,
the response complete, cancelled. Odd message orders and receive() hand-offs between the app and
the watcher, driven by hand-written servers.
"""

from __future__ import annotations

import asyncio

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, current_token, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Message, Receive, Scope, Send

from .helpers import (
    KeepAliveServer,
    QueueServer,
    read_body,
    receive_once,
    respond,
    slow_app,
    until,
    with_watchdog,
)
from .test_middleware import CANCELLED_RESPONSE

pytestmark = pytest.mark.anyio


REQUEST_DONE: Message = {"type": "http.request", "body": b"", "more_body": False}


class ServerGone(Exception):
    """What a server's receive() might raise (not an OSError: TimeoutError is one)."""


async def noop_send(message: Message) -> None:
    pass


async def noop_receive() -> Message:
    return REQUEST_DONE


async def test_watcher_receive_error_does_not_strand_a_parked_app_receive() -> None:
    fail = asyncio.Event()
    calls = 0

    async def receive() -> Message:
        nonlocal calls
        calls += 1
        if calls == 1:
            return REQUEST_DONE
        await fail.wait()
        raise ServerGone("connection reset")

    got: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await asyncio.sleep(0.01)  # the watcher now holds the server's receive
        try:
            await receive()  # parks behind the watcher (`reading` is set)
        except ServerGone as exc:
            got.append(str(exc))
            raise

    task = asyncio.create_task(CancelOnDisconnectMiddleware(app)(http_scope(), receive, noop_send))
    await until(lambda: calls == 2)
    await asyncio.sleep(0.01)
    fail.set()
    with pytest.raises(ServerGone, match="connection reset"):
        await with_watchdog(task, 1.0)
    # "The app will meet the same error on its own receive" (the comment in watch()).
    assert got == ["connection reset"]


async def test_watcher_giving_up_on_extra_requests_does_not_strand_a_parked_app() -> None:
    calls = 0

    async def receive() -> Message:
        """A server that answers every call after the body with an empty http.request."""
        nonlocal calls
        calls += 1
        if calls > 1:
            await asyncio.sleep(0.002)
        return dict(REQUEST_DONE)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await asyncio.sleep(0.003)  # the watcher started and holds the server's receive
        message = await receive()  # parks; the watcher then gives up without waking it
        assert message["type"] == "http.request"
        await respond(send)

    await with_watchdog(CancelOnDisconnectMiddleware(app)(http_scope(), receive, noop_send), 1.0)


async def test_read_ahead_zero_still_cancels_an_app_that_never_reads_the_body() -> None:
    events: list[str] = []
    conn = ClientConnection()  # a GET: one empty http.request
    middleware = CancelOnDisconnectMiddleware(slow_app(events, read=False), read_ahead=0)
    task = asyncio.create_task(conn.run(middleware))
    await asyncio.sleep(0.02)
    conn.disconnect()
    await with_watchdog(task, 1.0)
    assert events == ["cancelled"]


class FedServer:
    """A server whose receive() is a cancellation-safe queue fed over time by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.receive_calls = 0

    async def receive(self) -> Message:
        self.receive_calls += 1
        return await self.queue.get()

    async def feed(self, chunks: list[bytes], interval: float) -> None:
        for index, chunk in enumerate(chunks):
            more = index < len(chunks) - 1
            self.queue.put_nowait({"type": "http.request", "body": chunk, "more_body": more})
            await asyncio.sleep(interval)


@pytest.mark.parametrize("read_ahead", [0, 1, 9, 64 * 1024])
async def test_body_read_from_several_tasks_is_complete_and_in_order(read_ahead: int) -> None:
    """Three app tasks race for the body while the watcher reads ahead: no loss, no duplicate."""
    chunks = [bytes([65 + i]) * (i % 4 + 1) for i in range(30)]
    order: list[bytes] = []
    last = asyncio.Event()

    async def reader(receive: Receive, pause: float) -> None:
        while True:
            message = await receive()
            assert message["type"] == "http.request", message
            order.append(message["body"])
            if not message.get("more_body", False):
                last.set()
                return
            await asyncio.sleep(pause)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(0.003)  # the watcher has started and read ahead
        readers = [asyncio.create_task(reader(receive, p)) for p in (0, 0.0005, 0.001)]
        await asyncio.wait_for(last.wait(), 2)
        for task in readers:
            task.cancel()  # the others are parked (or reading): cancelling them is safe
        await asyncio.wait(readers)
        await respond(send)

    server = FedServer()
    feeder = asyncio.create_task(server.feed(chunks, 0.0003))
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=read_ahead)
    await with_watchdog(middleware(http_scope("POST"), server.receive, noop_send))
    await with_watchdog(feeder)
    assert order == chunks


@pytest.mark.parametrize("read_ahead", [0, 4, 64 * 1024])
async def test_app_receive_timing_out_repeatedly_loses_nothing(read_ahead: int) -> None:
    """`wait_for(receive(), tiny)` cancels parked/reading callers over and over: no loss."""
    chunks = [b"aa", b"bbb", b"c", b"dddd"]
    got: list[Message] = []
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), 0.001)
                except asyncio.TimeoutError:
                    continue
                got.append(message)
                if message["type"] != "http.request":
                    break
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("app saw the disconnect")
        await asyncio.sleep(30)  # ignores it: cancelled after the grace period

    server = FedServer()
    task = asyncio.create_task(
        CancelOnDisconnectMiddleware(app, read_ahead=read_ahead, grace=0.02)(
            http_scope("POST"), server.receive, noop_send
        )
    )
    await with_watchdog(server.feed(chunks, 0.004))
    await until(lambda: len(got) == len(chunks))
    await asyncio.sleep(0.01)
    server.queue.put_nowait({"type": "http.disconnect"})
    await with_watchdog(task)
    assert [m.get("body") for m in got[:4]] == chunks
    # Either the app's receive() got the disconnect (listening: grace, then cancel) or the
    # watcher got it while no receive() was pending (cancelled at once). Never a duplicate.
    assert got[4:] in ([{"type": "http.disconnect"}], [])
    assert events in (["app saw the disconnect"], ["cancelled"])


async def test_starlette_is_disconnected_polling_sees_the_cached_disconnect() -> None:
    """`Request.is_disconnected()` calls receive() in a pre-cancelled anyio scope."""
    from starlette.requests import Request

    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        await request.body()
        try:
            with shield():
                polls = 0
                while not await request.is_disconnected():
                    polls += 1
                    await asyncio.sleep(0.002)
                events.append(f"saw disconnect after polling={polls > 0}")
                await asyncio.sleep(0.01)  # still shielded: finish the unit of work
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection(b"payload", after_disconnect="block")  # hypercorn/daphne
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app), http_scope("POST")))
    await asyncio.sleep(0.02)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["saw disconnect after polling=True", "cancelled"]


async def test_background_task_receive_after_the_request_gets_the_cached_disconnect() -> None:
    """A task that outlives the request and calls receive() late must not block (hypercorn)."""
    late: list[Message] = []
    background: list[asyncio.Task[None]] = []

    async def later(receive: Receive) -> None:
        await asyncio.sleep(0.02)
        late.append(await asyncio.wait_for(receive(), 1))
        late_token.append(current_token().cancelled)

    late_token: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        background.append(asyncio.create_task(later(receive)))
        await asyncio.sleep(0.005)  # the watcher starts
        await respond(send)  # the server answers with http.disconnect right after

    conn = ClientConnection(after_disconnect="block")
    await with_watchdog(conn.run(CancelOnDisconnectMiddleware(app)))
    await with_watchdog(background[0])
    assert late == [{"type": "http.disconnect"}]
    assert late_token == [False]  # a disconnect after the response cancels nothing


async def test_disconnect_queued_before_the_app_starts() -> None:
    """Body and disconnect are both waiting before the first receive(): no send, no error."""
    events: list[str] = []
    server = QueueServer({"type": "http.request", "body": b"abc", "more_body": False})
    server.disconnect()
    middleware = CancelOnDisconnectMiddleware(slow_app(events, read=False))
    await with_watchdog(middleware(http_scope("POST"), server.receive, server.send))
    assert events == ["cancelled"]
    assert server.sent == CANCELLED_RESPONSE  # for an outer middleware; a server drops it
    assert server.receive_calls == 2  # body (buffered) then the disconnect; never again


async def test_disconnect_mid_body_while_app_reads_the_body_itself() -> None:
    """The app's own receive() meets the disconnect: the cancel lands in receive()."""
    events: list[str] = []
    received: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            while True:
                message = await receive()
                received.append(message["type"])
        except asyncio.CancelledError:
            events.append("cancelled in receive")
            raise

    conn = ClientConnection([b"1", b"2", b"3"], body_delay=0.01)
    middleware = CancelOnDisconnectMiddleware(app, read_ahead=0)  # the app does the reading
    task = asyncio.create_task(conn.run(middleware, http_scope("POST")))
    await until(lambda: len(received) == 1)
    conn.disconnect()
    await with_watchdog(task)
    # The disconnect is returned to nobody: the cancellation is delivered instead, so a
    # Starlette app does not turn it into ClientDisconnect / a 400.
    assert received == ["http.request"]
    assert events == ["cancelled in receive"]


@pytest.mark.parametrize("when", ["before-trailers", "after-trailers"])
async def test_trailers_keep_the_response_open_until_the_last_trailer(when: str) -> None:
    events: list[str] = []
    proceed = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [], "trailers": True})
        await send({"type": "http.response.body", "body": b"data", "more_body": False})
        try:
            if when == "after-trailers":
                await send(
                    {"type": "http.response.trailers", "headers": [], "more_trailers": False}
                )
            await proceed.wait()
            await asyncio.sleep(0.02)
            if when == "before-trailers":
                await send({"type": "http.response.trailers", "headers": []})
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("done")

    conn = ClientConnection(disconnect_after_response=False)
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: conn.receive_calls >= 2 and len(conn.sent) >= 2)
    conn.disconnect()
    proceed.set()
    await with_watchdog(task)
    assert events == (["cancelled"] if when == "before-trailers" else ["done"])


async def test_listener_pending_after_the_response_is_not_cancelled() -> None:
    """A receive() still pending after the final send: the post-response disconnect is normal."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        listener = asyncio.create_task(receive_once(receive))
        await asyncio.sleep(0.01)
        await respond(send)
        message = await asyncio.wait_for(listener, 1)
        try:
            await asyncio.sleep(0.05)  # post-response work
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append(f"{message['type']}, token cancelled={current_token().cancelled}")

    conn = ClientConnection()
    await with_watchdog(conn.run(CancelOnDisconnectMiddleware(app, grace=0.01)))
    assert events == ["http.disconnect, token cancelled=False"]


async def test_body_reader_woken_with_the_last_chunk_is_not_taken_for_a_listener() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await receive()
            await asyncio.sleep(0.003)  # the watcher starts and takes the server's receive
            body = first["body"] + await read_body(receive)  # parks behind the watcher
            events.append(f"body={body.decode()}")
            await asyncio.sleep(30)  # starts the expensive work
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    server = FedServer()
    server.queue.put_nowait({"type": "http.request", "body": b"a", "more_body": True})
    task = asyncio.create_task(
        CancelOnDisconnectMiddleware(app, grace=5)(http_scope("POST"), server.receive, noop_send)
    )
    await until(lambda: server.receive_calls >= 2)  # the watcher waits; the app parks behind it
    await asyncio.sleep(0.005)
    # The client sends its last chunk and closes at once: both arrive together.
    server.queue.put_nowait({"type": "http.request", "body": b"b", "more_body": False})
    server.queue.put_nowait({"type": "http.disconnect"})
    await with_watchdog(task, 1.0)  # cancelled at once, not after the 5 s grace
    # The cancellation lands in the body read (the reader was handed "b" but had not resumed
    # yet) or just after it: either way at once, not after a listener's grace.
    assert events in (["body=ab", "cancelled"], ["cancelled"])


@pytest.mark.parametrize("awaits", [False, True], ids=["never-awaits", "awaits"])
async def test_a_context_copied_in_the_final_send_keeps_nothing_of_the_server(
    awaits: bool,
) -> None:
    """The context variable holds the cycle, and a server may copy the request's context in
    its final send: the finished cycle must not hold the server's receive/send, or the
    server's per-request objects live on in a reference cycle (10x the generation-0
    collections under uvicorn with keep-alive)."""
    import gc
    import weakref

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if awaits:
            await asyncio.sleep(0)
        await respond(send)

    server = KeepAliveServer()
    kept = server.kept
    alive = weakref.ref(server)
    gc.disable()
    try:
        await with_watchdog(
            CancelOnDisconnectMiddleware(app)(http_scope(), server.receive, server.send)
        )
        del server
        assert len(kept) == 1  # the copied context is still held...
        assert alive() is None  # ...and the server's object was freed without the GC
    finally:
        gc.enable()
