"""A cancellation deferred by one `shield()` block never lands inside the next one.

When the client leaves during a `shield()` block, the app task's cancellation waits for the
block's end. If the app enters another `shield()` right after (two commits in a row), the
deferred cancellation must wait for that block too: it used to be issued one loop iteration
after the first block's exit, bypassing the token, and landed inside the second block.
"""

from __future__ import annotations

import anyio
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
