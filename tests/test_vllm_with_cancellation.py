"""The middleware stacked with an app that listens itself, in the shape of vLLM's
`with_cancellation` (vllm/entrypoints/serve/utils/api_utils.py): the handler runs in its own
task, a second task waits in `receive()` for `http.disconnect`, and the wrapper waits for the
first of the two with `asyncio.wait(FIRST_COMPLETED)`, which does not cancel the tasks it waits
on when the wrapper itself is cancelled. The middleware must not orphan the handler task.

The real-vLLM version of these checks is tests/vllm/test_openai_server.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import Message, Receive, Scope, Send

pytestmark = pytest.mark.anyio

WATCHDOG = 5.0


class Engine:
    """One fake generation: a token every 5 ms for 2 s."""

    def __init__(self) -> None:
        self.running = False
        self.tokens = 0

    async def generate(self) -> int:
        self.running = True
        try:
            for _ in range(400):
                await asyncio.sleep(0.005)
                self.tokens += 1
        finally:
            self.running = False
        return self.tokens


def with_cancellation_app(engine: Engine, outcome: dict[str, Any], *, yield_first: bool) -> Any:
    async def listen_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        if yield_first:
            # Some await between the body and the handler (a dependency, validation): the
            # middleware's watcher holds the server's receive before the listener asks.
            for _ in range(3):
                await asyncio.sleep(0)
        handler_task = asyncio.create_task(engine.generate())
        cancellation_task = asyncio.create_task(listen_for_disconnect(receive))
        outcome["handler_task"] = handler_task
        try:
            done, pending = await asyncio.wait(
                [handler_task, cancellation_task], return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            outcome["wrapper"] = "cancelled while waiting"
            raise
        for task in pending:
            task.cancel()
        outcome["wrapper"] = "handler done" if handler_task in done else "disconnect won"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"null"})

    return app


async def run(busy_loop_for: float, *, yield_first: bool) -> tuple[Engine, dict[str, Any]]:
    engine = Engine()
    outcome: dict[str, Any] = {}
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    app = with_cancellation_app(engine, outcome, yield_first=yield_first)
    middleware = CancelOnDisconnectMiddleware(app)
    request = asyncio.create_task(middleware(scope, receive, send))
    await asyncio.wait_for(_until(lambda: engine.tokens >= 5), WATCHDOG)

    async def other_work() -> None:
        # Ready in the same loop iteration as the disconnect: another connection's request,
        # a large batch of engine outputs, a garbage-collector pause.
        await gone.wait()
        time.sleep(busy_loop_for)  # noqa: ASYNC251 (blocking the loop is the point)

    busy = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    gone.set()
    try:
        await asyncio.wait_for(request, WATCHDOG)
        await asyncio.sleep(0.05)
    finally:
        await busy
        handler_task = outcome["handler_task"]
        orphaned = not handler_task.done()
        handler_task.cancel()
        await asyncio.wait([handler_task])
        outcome["orphaned"] = orphaned
    return engine, outcome


async def _until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 (a condition on foreign state, polled)
        await asyncio.sleep(0.001)


READERS = [
    pytest.param(False, id="listener-reads"),
    pytest.param(True, id="watcher-reads"),
]


@pytest.mark.parametrize("yield_first", READERS)
async def test_app_listening_itself_stops_its_handler_task(yield_first: bool) -> None:
    engine, outcome = await run(busy_loop_for=0.0, yield_first=yield_first)
    assert outcome["wrapper"] == "disconnect won"  # it got the message first and reacted
    assert not outcome["orphaned"]
    assert not engine.running


@pytest.mark.parametrize(
    "yield_first",
    [
        pytest.param(False, id="listener-reads"),
        pytest.param(True, id="watcher-reads"),
    ],
)
async def test_busy_loop_at_the_disconnect_does_not_orphan_the_handler_task(
    yield_first: bool,
) -> None:
    engine, outcome = await run(busy_loop_for=0.3, yield_first=yield_first)
    assert not outcome["orphaned"], outcome
    assert not engine.running
