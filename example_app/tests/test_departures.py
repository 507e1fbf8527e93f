"""DepartureRecorder (the `--no-middleware` baseline): it records a client leaving, nothing more."""

from __future__ import annotations

import asyncio

import pytest

from asgi_cancel._types import Message, Receive, Scope, Send
from example_app.departures import DepartureRecorder, when_client_leaves

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

WATCHDOG = 5.0
SCOPE: Scope = {"type": "http", "method": "POST", "path": "/", "headers": []}


class HypercornLike:
    """Body, then one `http.disconnect` when `leave()` is called, then blocks forever."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})
        self.sent: list[Message] = []

    def leave(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})

    async def receive(self) -> Message:
        return await self.queue.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)


async def test_a_client_leaving_is_recorded_and_the_app_keeps_running() -> None:
    server = HypercornLike()
    events: list[str] = []
    registered = asyncio.Event()
    finish = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "http.request"
        when_client_leaves(lambda: events.append("gone"))
        registered.set()
        await finish.wait()  # not cancelled: the recorder only records
        events.append("finished")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})

    task = asyncio.create_task(DepartureRecorder(app)(SCOPE, server.receive, server.send))
    await asyncio.wait_for(registered.wait(), WATCHDOG)
    server.leave()
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.001)
    assert events == ["gone"]
    finish.set()
    await asyncio.wait_for(task, WATCHDOG)
    assert events == ["gone", "finished"]


async def test_the_app_listening_itself_gets_the_disconnect_replayed() -> None:
    """Starlette's StreamingResponse listens below spec 2.4; it must still hear the client."""
    server = HypercornLike()
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        when_client_leaves(lambda: events.append("gone"))
        await asyncio.sleep(0.01)  # the recorder's reader holds the server's receive now
        server.leave()
        first, second = await asyncio.gather(receive(), receive())
        events.extend([first["type"], second["type"]])

    await asyncio.wait_for(DepartureRecorder(app)(SCOPE, server.receive, server.send), WATCHDOG)
    assert events == ["gone", "http.disconnect", "http.disconnect"]


async def test_a_disconnect_after_the_full_response_is_not_a_departure() -> None:
    """Every h1 server reports the connection closing after a normal response."""
    server = HypercornLike()
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        when_client_leaves(lambda: events.append("gone"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})
        server.leave()
        await asyncio.sleep(0.01)

    await asyncio.wait_for(DepartureRecorder(app)(SCOPE, server.receive, server.send), WATCHDOG)
    assert events == []


async def test_no_reader_task_outlives_the_request() -> None:
    server = HypercornLike()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        when_client_leaves(lambda: None)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    before = asyncio.all_tasks()
    await asyncio.wait_for(DepartureRecorder(app)(SCOPE, server.receive, server.send), WATCHDOG)
    assert asyncio.all_tasks() == before


def test_outside_any_request_registration_is_a_no_op() -> None:
    unregister = when_client_leaves(lambda: None)
    unregister()
