"""The same contract on trio (hypercorn -k trio, Starlette's TestClient trio backend)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import anyio
import pytest
import trio

from asgi_cancel import CancelOnDisconnectMiddleware, current_token, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Message, Receive, Scope, Send

from .helpers import (
    KeepAliveServer,
    read_body,
    run_capturing,
)

pytestmark = pytest.mark.anyio

WATCHDOG = 5


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


async def test_body_and_response_pass_through() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await trio.sleep(0.01)
        body = await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body[::-1]})

    conn = ClientConnection([b"abc", b"def", b"g"])
    with trio.fail_after(WATCHDOG):
        await conn.run(CancelOnDisconnectMiddleware(app, read_ahead=2), http_scope("POST"))
    assert conn.status == 200
    assert conn.body == b"gfedcba"


async def test_disconnect_cancels_with_a_cancel_scope() -> None:
    events: list[str] = []

    def cleanup() -> None:
        events.append("callback")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        token.on_cancel(cleanup)
        await read_body(receive)
        try:
            with shield():
                await token.wait()
                events.append("shielded section saw the token")
            await trio.sleep(30)
        except trio.Cancelled:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    with trio.fail_after(WATCHDOG):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run, CancelOnDisconnectMiddleware(app))
            while conn.receive_calls < 2:  # noqa: ASYNC110 (polling a plain counter)
                await trio.sleep(0.001)
            conn.disconnect()
    assert events == ["callback", "shielded section saw the token", "cancelled"]
    assert conn.app_exception is None


async def test_listening_app_gets_disconnect_and_replays() -> None:
    got: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(lambda: _append(got, receive))
            await trio.sleep(0.01)
            conn.disconnect()
        got.append(await receive())

    conn = ClientConnection(after_disconnect="block")
    with trio.fail_after(WATCHDOG):
        await conn.run(CancelOnDisconnectMiddleware(app, grace=2))
    assert got == [{"type": "http.disconnect"}] * 3


async def _append(got: list[Message], receive: Receive) -> None:
    got.append(await receive())


async def test_app_exception_propagates_unwrapped() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await trio.sleep(0.01)
        raise KeyError("boom")

    with trio.fail_after(WATCHDOG), pytest.raises(KeyError, match="boom"):
        await ClientConnection().run(CancelOnDisconnectMiddleware(app))


async def test_normal_response_then_disconnect_cancels_nothing() -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        await trio.sleep(0.05)  # post-response work while the server says disconnect
        events.append(f"background done, cancelled={current_token().cancelled}")

    with trio.fail_after(WATCHDOG):
        await ClientConnection().run(CancelOnDisconnectMiddleware(app))
    assert events == ["background done, cancelled=False"]


async def test_trio_raise_if_cancelled_in_a_worker_thread_ends_quietly() -> None:
    started = threading.Event()
    stopped: list[str] = []

    def blocking_work() -> None:
        token = current_token()
        started.set()
        for _ in range(500):  # bounded: 5 s at most
            try:
                token.raise_if_cancelled()
            except asyncio.CancelledError:
                stopped.append("thread stopped")
                raise
            time.sleep(0.01)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await trio.to_thread.run_sync(blocking_work)

    conn = ClientConnection()
    escaped: list[BaseException | None] = []

    async def run() -> None:
        escaped.append(
            await run_capturing(CancelOnDisconnectMiddleware(app), conn.receive, conn.send)
        )

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while not started.is_set() or conn.receive_calls < 2:  # noqa: ASYNC110
                await trio.sleep(0.001)
            conn.disconnect()
    assert stopped == ["thread stopped"]
    assert escaped == [None]


@pytest.mark.parametrize("cleanup", ["reraises", "raises-error"])
async def test_trio_outside_cancellation_reraises_the_apps_own_exception(cleanup: str) -> None:
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)
            events.append("cleanup done")
            if cleanup == "raises-error":
                raise RuntimeError("cleanup failed") from None
            raise

    async def run_quietly() -> None:  # conn.app_exception records what reached the server
        with contextlib.suppress(RuntimeError):
            await conn.run(CancelOnDisconnectMiddleware(app))

    conn = ClientConnection()
    with trio.fail_after(5):
        with trio.CancelScope() as outer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_quietly)
                while conn.receive_calls < 2:  # noqa: ASYNC110
                    await trio.sleep(0.001)
                outer.cancel()  # server shutdown
    assert events == ["cleanup done"]
    assert not current_token_is_set()
    if cleanup == "reraises":
        assert isinstance(conn.app_exception, trio.Cancelled)
    else:  # the app's error reaches the server (it is lost today)
        assert isinstance(conn.app_exception, RuntimeError)


async def test_trio_async_callback_finishes_before_the_request_ends() -> None:
    events: list[str] = []

    async def abort() -> None:
        await trio.sleep(0.02)
        events.append("abort finished")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        current_token().on_cancel(abort)
        await read_body(receive)
        try:
            await trio.sleep(30)
        except trio.Cancelled:
            events.append("app cancelled")
            raise

    conn = ClientConnection()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run, CancelOnDisconnectMiddleware(app))
            while conn.receive_calls < 2:  # noqa: ASYNC110
                await trio.sleep(0.001)
            conn.disconnect()
            with anyio.fail_after(1):
                while not conn.app_finished:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            events.append("request ended")
    assert events == ["app cancelled", "abort finished", "request ended"]


def current_token_is_set() -> bool:
    try:
        current_token()
    except RuntimeError:
        return False
    return True


async def test_a_context_copied_in_the_final_send_keeps_nothing_of_the_server() -> None:
    """As on asyncio (tests/test_cycle.py): the finished cycle lets the server's receive and
    send go, so a context copied in the final send does not keep them."""
    import gc
    import weakref

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await trio.lowlevel.checkpoint()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = KeepAliveServer()
    kept = server.kept
    alive = weakref.ref(server)
    gc.disable()
    try:
        with trio.fail_after(WATCHDOG):
            await CancelOnDisconnectMiddleware(app)(http_scope(), server.receive, server.send)
        del server
        assert len(kept) == 1
        assert alive() is None
    finally:
        gc.enable()
