"""What the middleware sends itself (`_responses.py`), to a server that may never return.

After the client left, the middleware completes the response for outer middlewares (a 499),
and after a stop it answers the client (504, 499) or ends its stream: every one of those sends
is bounded by `COMPLETION_TIMEOUT`, so a server whose send blocks on a dead connection
(hypercorn over HTTP/2 with data buffered; any outer middleware's send) never keeps the
request, and the server's task, alive.
"""

from __future__ import annotations

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel._responses import COMPLETION_TIMEOUT
from asgi_cancel.testing import ClientConnection
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

from .helpers import respond

pytestmark = pytest.mark.anyio
WATCHDOG = COMPLETION_TIMEOUT + 4.0


class SendNeverReturns(ClientConnection):
    """A server whose send() blocks forever once the client has gone (or always, with
    `always`): what an outer middleware or hypercorn-h2 can do."""

    def __init__(self, *, always: bool = False) -> None:
        super().__init__()
        self.always = always
        self.blocked: list[Message] = []

    async def send(self, message: Message) -> None:
        if self.disconnected or self.always:
            self.blocked.append(dict(message))
            await anyio.sleep_forever()
        await super().send(message)


def app_that(sends_in_cleanup: bool) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await anyio.sleep(30)
        finally:
            if sends_in_cleanup:
                with anyio.CancelScope(shield=True):
                    await respond(send, b"cleanup", 500)

    return app


@pytest.mark.parametrize("sends_in_cleanup", [False, True], ids=["sent-nothing", "cleanup-sends"])
async def test_the_499_to_a_send_that_never_returns_is_bounded(sends_in_cleanup: bool) -> None:
    conn = SendNeverReturns()
    middleware = CancelOnDisconnectMiddleware(app_that(sends_in_cleanup))
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware)
            await anyio.sleep(0.05)
            conn.disconnect()
    assert conn.app_finished
    assert conn.app_exception is None
    # The app's own sends after the disconnect were dropped; the middleware's 499 was tried.
    assert conn.blocked == [{"type": "http.response.start", "status": 499, "headers": []}]


async def test_the_answer_to_a_stopped_request_is_bounded_too() -> None:
    """A deadline passes while the client is still connected, and the server's send blocks."""
    conn = SendNeverReturns(always=True)
    middleware = CancelOnDisconnectMiddleware(app_that(False), timeout=0.05)
    with anyio.fail_after(WATCHDOG):
        await conn.run(middleware)
    assert conn.app_exception is None
    assert [message["status"] for message in conn.blocked] == [504]
