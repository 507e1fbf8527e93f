"""The trio driver (`_trio.py`): the app's cancellation is a cancel scope, level-triggered, and
`shield()` is a shielded cancel scope, so it defers an outside cancellation too. The rest of the
contract runs on trio with every other test."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from asgi_cancel import CancelOnDisconnectMiddleware, shield
from asgi_cancel.testing import ClientConnection
from asgi_cancel.types import Receive, Scope, Send

from .helpers import WATCHDOG, leave, read_body, run_quietly

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["trio"])]


async def test_the_cancellation_is_level_triggered_until_the_app_ends() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            try:
                await trio.lowlevel.checkpoint()
            except trio.Cancelled:
                events.append("cancelled again at the next checkpoint")
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)
                events.append("shielded cleanup done")
            raise

    conn = await leave(CancelOnDisconnectMiddleware(app))
    assert events == ["cancelled again at the next checkpoint", "shielded cleanup done"]
    assert conn.app_exception is None


async def test_shield_defers_an_outside_cancellation_to_the_blocks_end() -> None:
    events: list[str] = []
    entered = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            with shield():
                entered.set()
                await trio.sleep(0.05)  # the server shuts down meanwhile
                events.append("critical section done")
            await trio.sleep(30)
        except trio.Cancelled:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    with trio.fail_after(WATCHDOG), trio.CancelScope() as outer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_quietly, conn, CancelOnDisconnectMiddleware(app))
            await entered.wait()
            outer.cancel()  # server shutdown
    assert events == ["critical section done", "cancelled"]
    assert isinstance(conn.app_exception, trio.Cancelled)
