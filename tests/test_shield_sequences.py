"""A cancellation deferred by one `shield()` block never lands inside the next one.

When the client leaves during a `shield()` block, the app task's cancellation waits for the
block's end. If the app enters another `shield()` right after (two commits in a row), the
deferred cancellation must wait for that block too: it used to be issued one loop iteration
after the first block's exit, bypassing the token, and landed inside the second block.
"""

from __future__ import annotations

import time

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, shield
from asgi_cancel.testing import ClientConnection
from asgi_cancel.types import Receive, Scope, Send

pytestmark = pytest.mark.anyio


async def test_a_shield_right_after_a_shield_is_not_interrupted() -> None:
    events: list[str] = []
    conn = ClientConnection()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with shield():
                conn.disconnect()  # the client leaves during the first commit
                await anyio.sleep(0.05)
                events.append("first commit done")
            with shield():  # entered synchronously after the first block's exit
                await anyio.sleep(0.05)
                events.append("second commit done")
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise

    with anyio.fail_after(5):
        await conn.run(CancelOnDisconnectMiddleware(app, watch_delay=0))
    assert events == ["first commit done", "second commit done", "cancelled"]


async def test_a_shield_in_a_worker_thread_defers_the_cancellation_past_its_end() -> None:
    """Sync code in a worker thread (a FastAPI `def` endpoint) commits inside `shield()`: the
    block runs to its end, and the request is cancelled at the app's next await."""
    events: list[str] = []
    conn = ClientConnection()

    def commit() -> None:
        with shield():
            anyio.from_thread.run_sync(conn.disconnect)  # the client leaves mid-commit
            time.sleep(0.05)
            events.append("committed")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await anyio.to_thread.run_sync(commit)
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise

    with anyio.fail_after(5):
        await conn.run(CancelOnDisconnectMiddleware(app, watch_delay=0))
    assert events == ["committed", "cancelled"]
