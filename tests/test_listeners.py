"""Apps that listen for the disconnect themselves (contract line 9), whatever the order in
which the server gives the messages.

uvicorn answers the first `receive()` with `http.disconnect` when the client left before it:
an app listening in `receive()` must get the same grace as when the empty body comes first.
sse-starlette's `BackgroundTask`, which runs after its own disconnect listener ends, never ran
under the middleware in that order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

from .helpers import noting_cancellation, running, with_watchdog

pytestmark = pytest.mark.anyio


class LeftBeforeTheBody(ClientConnection):
    """A server that, like uvicorn for a client gone before the first `receive()`, answers
    that first call with `http.disconnect` instead of the (empty) body."""

    def __init__(self) -> None:
        super().__init__()
        self.disconnect()

    async def receive(self) -> Message:
        self.receive_calls += 1
        return {"type": "http.disconnect"}


def sse_app(events: list[str]) -> ASGIApp:
    async def endless() -> AsyncIterator[dict[str, str]]:
        while True:
            yield {"data": "tick"}
            await anyio.sleep(0.01)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        background = BackgroundTask(events.append, "background ran")
        await EventSourceResponse(endless(), background=background)(scope, request.receive, send)
        events.append("returned")

    return app


@pytest.mark.parametrize("order", ["disconnect-first", "body-first"])
async def test_sse_starlettes_background_task_runs_whatever_the_order(order: str) -> None:
    events: list[str] = []
    conn = LeftBeforeTheBody() if order == "disconnect-first" else ClientConnection()
    middleware = CancelOnDisconnectMiddleware(sse_app(events))
    async with running(middleware, http_scope("GET", "/events"), conn):
        if order == "body-first":
            await conn.wait_for_body_chunks(2)
            conn.disconnect()
    assert events == ["background ran", "returned"]


async def test_a_body_reader_of_a_post_is_still_cancelled_at_once() -> None:
    """Not a listener: a POST that announces its body and meets the disconnect first is
    cancelled in its receive(), not handed a message a framework turns into an error."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with noting_cancellation(events):
            message = await receive()
            events.append(message["type"])
            await anyio.sleep(30)

    scope = http_scope("POST", "/upload", headers=[(b"content-length", b"10")])
    await with_watchdog(LeftBeforeTheBody().run(CancelOnDisconnectMiddleware(app), scope))
    assert events == ["cancelled"]


def test_is_disconnected_after_the_response_sees_the_end_at_once() -> None:
    """Starlette's `Request.is_disconnected()` polls `receive()` in a cancelled scope: once the
    response is complete the app reads the server's receive itself (a disconnect then cancels
    nothing), so the poll gets the server's answer as without the middleware."""
    from starlette.responses import JSONResponse
    from starlette.testclient import TestClient

    seen: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        await request.body()
        await JSONResponse({})(scope, receive, send)
        seen.append(await request.is_disconnected())

    client = TestClient(CancelOnDisconnectMiddleware(app))
    for _ in range(20):
        assert client.post("/", content="x").status_code == 200
    assert seen == [True] * 20
