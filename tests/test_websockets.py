"""WebSocket sessions (`_session.py`, docs/contract.md lines 20-24): the session's token, one
cancellation on `websocket.disconnect`, messages read ahead in order and within a bound, the
disconnect replayed, stops by id and deadline closing the socket, and `turn()`. On asyncio and
trio, against a scripted server (tests/servers/test_websockets.py has the real ones)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    CancelToken,
    current_token,
    detach,
    shield,
    turn,
)
from asgi_cancel.types import ASGIApp, CancelledRequest, Message, Receive, Scope, Send

from .helpers import (
    WATCHDOG,
    QueueServer,
    noting_cancellation,
    receive_into,
    serving,
    until,
    with_watchdog,
)

pytestmark = pytest.mark.anyio

GRACE = 0.05
CONNECT: Message = {"type": "websocket.connect"}


def ws_scope(request_id: bytes | None = None) -> Scope:
    headers = [] if request_id is None else [(b"x-request-id", request_id)]
    return {"type": "websocket", "path": "/ws", "headers": headers, "subprotocols": []}


def text(value: str) -> Message:
    return {"type": "websocket.receive", "text": value}


def gone(code: int = 1001, reason: str = "") -> Message:
    return {"type": "websocket.disconnect", "code": code, "reason": reason}


@contextlib.asynccontextmanager
async def session(
    app: ASGIApp, *messages: Message, scope: Scope | None = None, **options: Any
) -> AsyncIterator[QueueServer]:
    """`app` under the middleware (`options`), serving one session while the block runs to a
    server whose client connects, then sends `messages`; the block's end waits for it
    (watchdog'd)."""
    server = QueueServer(CONNECT, *messages)
    middleware = CancelOnDisconnectMiddleware(app, **options)
    async with serving(middleware, scope or ws_scope(), server.receive, server.send):
        yield server


def sent_types(server: QueueServer) -> list[str]:
    return [message["type"] for message in server.sent]


async def accept(receive: Receive, send: Send) -> None:
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})


async def idle(scope: Scope, receive: Receive, send: Send) -> None:
    """Accepts, then works until it is stopped."""
    await accept(receive, send)
    await anyio.sleep(30)


# -- 20. the client leaves: the session's token, one cancellation --------------------------------
async def test_a_client_that_leaves_stops_a_busy_session_once() -> None:
    """An app busy generating (not in receive()) is cancelled once; its sends after the
    disconnect never reach the server; the hook sees the close code."""
    events: list[Any] = []
    records: list[CancelledRequest] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        token = current_token()
        try:
            while True:
                await send({"type": "websocket.send", "text": "token"})
                await anyio.sleep(0.005)
        except anyio.get_cancelled_exc_class():
            events.append(("cancelled", token.reason))
            await send({"type": "websocket.send", "text": "after"})  # dropped
            raise

    async with session(app, on_cancelled=records.append) as server:
        await until(lambda: len(server.sent) >= 3)
        server.put(gone(1001))
    assert events == [("cancelled", "client disconnected")]
    assert {"type": "websocket.send", "text": "after"} not in server.sent
    assert sent_types(server)[0] == "websocket.accept"
    assert len(records) == 1
    assert records[0].close_code == 1001
    assert records[0].response_started is True  # accepted


async def test_a_disconnect_before_accept_stops_the_handshake() -> None:
    """The app reads `websocket.connect`, then works before accepting (auth): the client's
    leaving cancels it there, and the middleware answers the handshake the app left unanswered
    with a close (the server's refusal; without one uvicorn's `--ws websockets` logs an ERROR,
    "ASGI callable returned without sending handshake")."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        with noting_cancellation(events):
            await anyio.sleep(30)  # checks a token with an identity provider
        await send({"type": "websocket.accept"})  # pragma: no cover

    async with session(app) as server:
        await until(lambda: server.receive_calls >= 2)  # the watcher waits past the connect
        server.put(gone(1006))
    assert events == ["cancelled"]
    assert server.sent == [{"type": "websocket.close", "code": 1000, "reason": ""}]


class Disconnected(RuntimeError):
    """What daphne's send raises once its client has gone (autobahn's, not an OSError)."""


Disconnected.__module__ = "autobahn.exception"


SEND_ERRORS = {
    "OSError": (ConnectionResetError("the client has gone"), True),  # uvicorn's ClientDisconnected
    "daphne": (Disconnected("Attempt to send on a closed protocol"), True),
    "other": (RuntimeError("Unexpected ASGI message 'websocket.send'"), False),  # the app's own
}


@pytest.mark.parametrize(("error", "gone"), SEND_ERRORS.values(), ids=SEND_ERRORS)
async def test_a_send_that_fails_before_the_disconnect_still_fires_the_token(
    error: Exception, gone: bool
) -> None:
    """uvicorn fails a send once the client's close frame has arrived (ClientDisconnected, an
    OSError: ASGI 2.4), sometimes before its receive() hands the disconnect to the watcher;
    daphne likewise (autobahn's Disconnected). The app ends on that error, as it comes; the
    session's token must have fired all the same: an engine aborted by the token
    (`abort_on_cancel`) would otherwise generate on for nobody. Any other error is the app's
    own: nothing fires."""
    records: list[CancelledRequest] = []
    tokens: list[CancelToken] = []
    server = QueueServer(CONNECT)  # the disconnect has not reached receive() yet

    async def send(message: Message) -> None:
        if len(server.sent) >= 3:
            raise error
        server.sent.append(message)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        tokens.append(current_token())
        while True:  # streaming, never in receive()
            await send({"type": "websocket.send", "text": "token"})
            await anyio.sleep(0.001)

    middleware = CancelOnDisconnectMiddleware(app, on_cancelled=records.append)
    with anyio.fail_after(WATCHDOG), pytest.raises(type(error)):
        await middleware(ws_scope(), server.receive, send)
    assert tokens[0].cancelled is gone
    assert len(records) == gone
    if gone:
        assert records[0].reason == "client disconnected"
        assert records[0].response_started
        assert records[0].close_code is None  # the server's send said no code


async def test_an_app_that_goes_on_after_a_failed_send_is_cancelled_at_the_disconnect() -> None:
    """A ticker that skips a send that failed (the client gone) would tick for nobody: the
    disconnect that follows cancels it, `grace` later."""
    events: list[str] = []
    server = QueueServer(CONNECT)

    async def send(message: Message) -> None:
        if message["type"] == "websocket.send" and message["text"] == "tick 3":
            server.put(gone(1006))  # the server hands over the disconnect after failing
            raise ConnectionResetError("the client has gone")
        server.sent.append(message)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        with noting_cancellation(events):
            for tick in range(1000):
                with contextlib.suppress(OSError):
                    await send({"type": "websocket.send", "text": f"tick {tick}"})
                await anyio.sleep(0.001)
            events.append("ran to the end")

    middleware = CancelOnDisconnectMiddleware(app, grace=GRACE)
    await with_watchdog(middleware(ws_scope(), server.receive, send))
    assert events == ["cancelled"]


# -- 21. messages: in order, none lost, within read_ahead ----------------------------------------
async def test_messages_reach_the_app_in_order_and_the_read_ahead_is_bounded() -> None:
    """The client sends 40 messages while the app sleeps: the middleware reads ahead only up
    to `read_ahead` (the server's own backpressure applies past it), and the app then gets all
    of them, in order, none twice."""
    got: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        await anyio.sleep(0.05)
        while len(got) < 40:
            message = await receive()
            got.append(message["text"])
        await send({"type": "websocket.close", "code": 1000})

    messages = [text(f"m{index:02}") for index in range(40)]
    # Each message counts its payload and 100 bytes: 3 fit in 400 bytes, a 4th does not.
    async with session(app, *messages, read_ahead=400) as server:
        await anyio.sleep(0.03)
        assert server.receive_calls <= 1 + 5  # the connect, then a few read ahead: bounded
    assert got == [f"m{index:02}" for index in range(40)]
    assert sent_types(server) == ["websocket.accept", "websocket.close"]


@pytest.mark.parametrize("kind", ["bytes", "text"])
async def test_the_read_ahead_counts_bytes_for_text_too(kind: str) -> None:
    """Non-ASCII text counts its UTF-8 bytes against `read_ahead`, as binary messages do: 2
    messages of 3,000 bytes (1,000 characters of 3 bytes each) fill a 4,000-byte bound."""
    payload = "\u20ac" * 1000  # 3,000 bytes in UTF-8
    checked = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        await checked.wait()
        await send({"type": "websocket.close", "code": 1000})

    key, value = ("bytes", payload.encode()) if kind == "bytes" else ("text", payload)
    messages = [{"type": "websocket.receive", key: value} for _ in range(6)]
    async with session(app, *messages, read_ahead=4000) as server:
        await until(lambda: server.receive_calls >= 1 + 2)  # the connect, then two messages
        await anyio.sleep(0.05)
        assert server.receive_calls == 1 + 2  # and no more: the bound
        checked.set()


async def test_the_disconnect_is_replayed_to_every_caller_as_a_fresh_message() -> None:
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        async with anyio.create_task_group() as readers:
            for _ in range(2):
                readers.start_soon(receive_into, seen, receive)
        seen[0]["code"] = 0  # an app that changes its message changes nothing for others
        seen.append(await receive())

    async with session(app, grace=1.0) as server:
        await until(lambda: server.receive_calls >= 2)
        server.put(gone(4001, "bye"))
    assert [message["code"] for message in seen] == [0, 4001, 4001]
    assert all(message["reason"] == "bye" for message in seen)
    assert server.receive_calls == 2  # the server's receive() is never called again after it


# -- 22. an app that listens itself --------------------------------------------------------------
@pytest.mark.parametrize("reacts", [True, False], ids=["reacts", "ignores it"])
async def test_an_app_in_receive_gets_the_disconnect_first(reacts: bool) -> None:
    """A chat loop waits in receive(): it gets the disconnect and ends by itself, not
    cancelled; one that ignores it is cancelled `grace` later."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        message = await receive()
        events.append(message["type"])
        if reacts:
            return
        with noting_cancellation(events):
            await anyio.sleep(30)

    async with session(app, grace=GRACE) as server:
        await until(lambda: server.receive_calls >= 2)
        server.put(gone())
    expected = ["websocket.disconnect"] + ([] if reacts else ["cancelled"])
    assert events == expected


# -- 23. stopped by id, by a deadline; refused at the edge ---------------------------------------
CLOSE_REASONS = {
    "default": ({}, "cancelled by id"),
    # 200 bytes of UTF-8, cut to 122: the 62nd character would not fit whole.
    "long": ({"reason": "\u00e9" * 100}, "\u00e9" * 61),
}


@pytest.mark.parametrize(("given", "reason"), CLOSE_REASONS.values(), ids=CLOSE_REASONS)
async def test_a_session_cancelled_by_id_is_closed_with_4499_and_a_reason_that_fits(
    given: dict[str, str], reason: str
) -> None:
    """A close frame's reason holds 123 bytes (RFC 6455): a longer one is cut at a character's
    boundary, or servers send no close at all (uvicorn's websockets) or an invalid one."""
    registry = CancelRegistry()
    ids: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        ids.append(current_token().request_id)
        await anyio.sleep(30)

    async with session(app, scope=ws_scope(b"session-1"), registry=registry) as server:
        await until(lambda: bool(ids))
        assert registry.cancel("session-1", **given)
    assert ids == ["session-1"]
    accepted, closed = server.sent
    assert (b"x-request-id", b"session-1") in accepted["headers"]
    assert closed == {"type": "websocket.close", "code": 4499, "reason": reason}


async def test_a_detached_session_is_not_stopped_by_id_and_runs_to_its_end() -> None:
    registry = CancelRegistry()
    events: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        with detach():
            events.append("saving")
            await anyio.sleep(0.1)  # the cancel comes meanwhile
            events.append("saved")
        await send({"type": "websocket.close", "code": 1000})

    async with session(app, scope=ws_scope(b"session-1"), registry=registry) as server:
        await until(lambda: bool(events))
        events.append(("cancel", registry.cancel("session-1")))
    assert events == ["saving", ("cancel", False), "saved"]
    assert server.sent[-1] == {"type": "websocket.close", "code": 1000}


async def test_nothing_the_client_sends_after_a_stop_reaches_the_app() -> None:
    """Stopped by id while the app listens: it gets the made-up disconnect, and so does every
    later receive(), even once the client has sent more (the watcher still waited for it)."""
    registry = CancelRegistry()
    seen: list[Any] = []
    listening: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        listening.append(True)  # (no checkpoint until receive() parks: the test then goes on)
        seen.append((await receive()).get("code"))
        await anyio.sleep(0.05)  # the client's message comes meanwhile
        seen.append((await receive()).get("code"))

    async with session(app, scope=ws_scope(b"s-2"), registry=registry, grace=1.0) as server:
        # The app waits in receive() (listening: it gets the disconnect, and `grace`; one not
        # yet there is cancelled at once) and the watcher in the server's.
        await until(lambda: bool(listening) and server.receive_calls >= 2)
        assert registry.cancel("s-2")
        await anyio.sleep(0.01)
        server.put(text("sent after the stop"))
    assert seen == [4499, 4499]


async def test_a_session_past_its_deadline_is_closed_with_4504() -> None:
    async with session(idle, session_timeout=0.05, timeout=0.001) as server:
        pass
    closed = {"type": "websocket.close", "code": 4504, "reason": "deadline exceeded"}
    assert server.sent[-1] == closed


@pytest.mark.parametrize("denial", [False, True], ids=["close", "denial response"])
async def test_a_malformed_id_refuses_the_handshake(denial: bool) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not called")  # pragma: no cover

    scope = ws_scope(b"bad id\r\n")
    if denial:
        scope["extensions"] = {"websocket.http.response": {}}
    async with session(app, scope=scope, registry=CancelRegistry()) as server:
        pass
    if denial:
        assert sent_types(server) == [
            "websocket.http.response.start",
            "websocket.http.response.body",
        ]
        assert server.sent[0]["status"] == 400
    else:
        assert [(m["type"], m["code"]) for m in server.sent] == [("websocket.close", 4400)]


# -- 24. turns ------------------------------------------------------------------------------------
async def test_a_turn_cancelled_alone_leaves_the_session_open() -> None:
    """Realtime's `response.cancel`: the reader loop cancels the response in flight; the
    response's task ends its turn (the block absorbs it) and says so; the session goes on."""
    events: list[Any] = []
    running: list[turn] = []

    async def respond(send: Send) -> None:
        session = current_token()
        current = turn()
        running.append(current)
        with current as token:
            assert current_token() is token
            assert token is not session
            try:
                await anyio.sleep(30)  # the engine generates
            except anyio.get_cancelled_exc_class():
                events.append(("turn cancelled", token.reason, session.cancelled))
                raise
        events.append("after the turn")
        await send({"type": "websocket.send", "text": "response.cancelled"})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        async with anyio.create_task_group() as responses:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message["text"] == "response.create":
                    responses.start_soon(respond, send)
                elif message["text"] == "response.cancel":
                    running[-1].cancel("response.cancel")

    async with session(app, text("response.create")) as server:
        await until(lambda: bool(running))
        server.put(text("response.cancel"))
        await until(lambda: "after the turn" in events)
        server.put(gone(1000))
    assert events == [("turn cancelled", "response.cancel", False), "after the turn"]
    assert {"type": "websocket.send", "text": "response.cancelled"} in server.sent


@pytest.mark.parametrize("how", ["worker-thread", "own-code-leaves", "own-code-awaits"])
async def test_a_turn_cancelled_alone_ends_there_and_only_there(how: str) -> None:
    """Sync generation in a worker thread checks the turn's token (`raise_if_cancelled()`): its
    CancelledError ends the turn's block, not the session. The turn's own code cancels it (it
    read a `response.cancel` itself): the cancellation lands at the turn's next await, or
    nowhere if the block is left first; never after it."""
    events: list[str] = []
    running: list[turn] = []

    def generate() -> None:
        token = current_token()
        for _ in range(1000):
            token.raise_if_cancelled()
            time.sleep(0.005)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        current = turn()
        running.append(current)
        with current:
            if how == "worker-thread":
                await anyio.to_thread.run_sync(generate)
            else:
                await anyio.lowlevel.checkpoint()
                current.cancel()
                if how == "own-code-awaits":
                    await anyio.sleep(30)
        events.append("after the turn")
        await anyio.sleep(0.01)
        events.append("session goes on")
        await send({"type": "websocket.close", "code": 1000})

    async with session(app) as server:
        if how == "worker-thread":  # cancelled from outside, mid-generation
            await until(lambda: bool(running))
            await anyio.sleep(0.02)
            running[0].cancel()
        await until(lambda: "session goes on" in events)
    assert events == ["after the turn", "session goes on"]
    assert sent_types(server) == ["websocket.accept", "websocket.close"]


async def test_a_closing_socket_cancels_the_turn_in_flight() -> None:
    """A response running in a task of its own when the client leaves: its turn's token
    fires with the session's reason, and its task is cancelled."""
    events: list[Any] = []
    tokens: list[CancelToken] = []

    async def respond() -> None:
        with turn() as token:
            tokens.append(token)
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                events.append(("turn cancelled", token.reason))
                raise

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        async with anyio.create_task_group() as responses:
            responses.start_soon(respond)
            await anyio.sleep(30)

    async with session(app) as server:
        await until(lambda: bool(tokens))
        server.put(gone(1001))
    assert events == [("turn cancelled", "client disconnected")]
    assert tokens[0].cancelled


# What a commit inside a turn holds off the session's cancellation with, and what runs after it.
KEEPS: dict[str, tuple[Callable[[], AbstractContextManager[object]], list[str]]] = {
    "shield": (shield, ["block done", "cancelled"]),
    "detach": (detach, ["block done", "rest of the turn", "cancelled"]),
    "neither": (nullcontext, ["cancelled"]),
}


@pytest.mark.parametrize(("keep", "after"), KEEPS.values(), ids=KEEPS)
async def test_the_sessions_cancellation_goes_through_a_turn_in_its_task(
    keep: Callable[[], AbstractContextManager[object]], after: list[str]
) -> None:
    """The client leaves while a turn runs in the session's own task: the cancellation goes
    through the turn's block (the turn does not take it for its own, Python 3.10 included) and
    ends the session. A commit inside the turn holds it off: it waits for the end of the
    shield() block, or of the turn that detached, then lands."""
    events: list[str] = []
    hold = 30 if keep is nullcontext else 0.2  # the client leaves meanwhile

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        with noting_cancellation(events):
            with turn():
                with keep():
                    events.append("in the block")
                    await anyio.sleep(hold)
                    events.append("block done")
                await anyio.lowlevel.checkpoint()  # a shield's deferred cancellation lands here
                events.append("rest of the turn")
            await anyio.sleep(30)

    async with session(app) as server:
        await until(lambda: "in the block" in events)
        server.put(gone(1001))
    assert events == ["in the block", *after]


async def test_a_turn_outside_a_request_or_in_a_worker_thread_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="outside a request"):
        with turn():
            pass  # pragma: no cover

    def in_thread() -> None:
        with pytest.raises(RuntimeError, match=r"turn\(\) was entered in a worker thread"):
            with turn():
                pass  # pragma: no cover

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await accept(receive, send)
        await anyio.to_thread.run_sync(in_thread)
        await send({"type": "websocket.close", "code": 1000})

    async with session(app) as server:
        pass
    assert sent_types(server) == ["websocket.accept", "websocket.close"]


# -- metrics and the log line ---------------------------------------------------------------------
async def test_a_cancelled_session_is_logged_and_counted_with_its_phase_and_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import CollectorRegistry

    from asgi_cancel.prometheus import CancelMetrics

    registry = CollectorRegistry()
    with caplog.at_level("INFO", logger="asgi_cancel"):
        async with session(idle, on_cancelled=CancelMetrics(registry=registry)) as server:
            await until(lambda: server.receive_calls >= 2)
            server.put(gone(1001))
    (line,) = [r for r in caplog.records if "cancelled after" in r.getMessage()]
    message = line.getMessage()
    assert message.startswith("WEBSOCKET /ws cancelled after ")
    assert message.endswith("in the session: client disconnected (close 1001)")
    labels = {"method": "WEBSOCKET", "route": "unmatched", "reason": "client disconnected"}
    counted = registry.get_sample_value(
        "asgi_cancel_cancelled_requests_total", labels | {"phase": "session"}
    )
    assert counted == 1.0
