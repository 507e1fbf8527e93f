"""DepartureRecorder (the `--no-middleware` baseline): it records a client leaving, nothing more.

What it records, and that the app runs on and still hears the client leave, the servers show:
test_disconnect.py (`clients_gone`, without the middleware). Here, what they cannot show.
"""

from __future__ import annotations

import asyncio

import pytest

from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send
from example_app.departures import DepartureRecorder, when_client_leaves

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

WATCHDOG = 5.0
SCOPE: Scope = {"type": "http", "method": "POST", "path": "/", "headers": []}


class HypercornLike:
    """The body, then one `http.disconnect` once `leave()` is called, then blocks forever."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})

    def leave(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})

    async def receive(self) -> Message:
        return await self.queue.get()

    async def run(self, app: ASGIApp) -> None:
        async def send(message: Message) -> None:
            pass

        await asyncio.wait_for(DepartureRecorder(app)(SCOPE, self.receive, send), WATCHDOG)


async def respond(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})


async def test_a_disconnect_after_the_full_response_is_not_a_departure() -> None:
    """Every h1 server reports the connection closing after a normal response."""
    server = HypercornLike()
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        when_client_leaves(lambda: events.append("gone"))
        await respond(send)
        server.leave()
        await asyncio.sleep(0.01)

    before = asyncio.all_tasks()
    await server.run(app)
    assert events == []
    assert asyncio.all_tasks() == before  # no reader task outlives the request


async def test_an_unregistered_callback_is_not_called() -> None:
    server = HypercornLike()
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        unregister = when_client_leaves(lambda: events.append("gone"))
        unregister()
        server.leave()
        events.append((await receive())["type"])  # the app still hears the client leave

    await server.run(app)
    assert events == ["http.disconnect"]
    # Outside any request there is nothing to register with: no error, and nothing is called.
    when_client_leaves(lambda: events.append("outside"))()
    assert events == ["http.disconnect"]
