"""A disconnect while the server's send of the final response message is still in flight.

hypercorn over HTTP/2 never returns that send once the connection closed with the data still
buffered (tests/servers/test_h2.py has the real case): the middleware cancels an app still in
it `grace` after the disconnect. A send that returns late but within `grace` (hypercorn on trio
delivers the end-of-response disconnect before its send returns) is the normal end: nothing is
cancelled, and work after the response runs to its end.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, current_token
from asgi_cancel.testing import ClientConnection

from .servers.events import Message, Receive, Scope, Send

pytestmark = pytest.mark.anyio

WATCHDOG = 5.0
GRACE = 0.05


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


class FinalSendInFlight(ClientConnection):
    """The client leaves while the final body message waits in the server's `send`, which
    then returns after `returns_after` seconds (None: never, as hypercorn h2)."""

    def __init__(self, returns_after: float | None) -> None:
        super().__init__(disconnect_after_response=False)
        self.returns_after = returns_after

    async def send(self, message: Message) -> None:
        await super().send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.disconnect()
            if self.returns_after is None:
                await anyio.sleep_forever()
            else:
                await anyio.sleep(self.returns_after)


def app_with_work_after_the_response(events: list[Any]) -> Any:
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

    return app


async def run(returns_after: float | None) -> tuple[list[Any], list[tuple[str, bool]], bytes]:
    """The app's events, the on_cancelled reports and the body the server was handed."""
    events: list[Any] = []
    reports: list[tuple[str, bool]] = []
    middleware = CancelOnDisconnectMiddleware(
        app_with_work_after_the_response(events),
        grace=GRACE,
        on_cancelled=lambda scope, **report: reports.append(
            (report["reason"], report["response_started"])
        ),
    )
    connection = FinalSendInFlight(returns_after)
    with anyio.fail_after(WATCHDOG):
        await connection.run(middleware)
    return events, reports, connection.body


async def test_a_final_send_that_never_returns_is_cancelled_after_grace() -> None:
    events, reports, body = await run(returns_after=None)
    cancelled = anyio.get_cancelled_exc_class().__name__
    assert events == [("send raised", cancelled, "client disconnected")]
    assert reports == [("client disconnected", True)]
    assert body == b"done"  # handed to the server; it never reached the client


async def test_a_final_send_that_returns_within_grace_is_the_normal_end() -> None:
    events, reports, _ = await run(returns_after=GRACE / 5)
    assert events == ["send returned", ("work done", False)]
    assert reports == []
