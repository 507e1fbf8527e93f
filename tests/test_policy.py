"""Per-route policy: `exclude=` at the front door, `detach()` for one endpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, current_token, detach, shield
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .helpers import respond, until, with_watchdog

pytestmark = pytest.mark.anyio


def runs_to_the_end(events: list[str], *, seconds: float = 0.1) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        events.append("started")
        await asyncio.sleep(seconds)
        events.append("finished")
        await respond(send)

    return app


@pytest.mark.parametrize(
    "exclude",
    [("/payments/",), "/payments/", lambda scope: scope["path"].startswith("/payments/")],
    ids=["prefixes", "one-prefix", "predicate"],
)
async def test_excluded_route_passed_through_untouched_and_not_cancelled(exclude: Any) -> None:
    seen: list[tuple[Receive, Send]] = []
    events: list[str] = []
    inner = runs_to_the_end(events)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((receive, send))
        await inner(scope, receive, send)

    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(app, exclude=exclude, watch_delay=0)
    task = asyncio.create_task(conn.run(middleware, http_scope("POST", "/payments/42")))
    await until(lambda: events == ["started"])
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["started", "finished"]
    assert seen == [(conn.receive, conn.send)]  # the server's own callables


async def test_route_not_excluded_still_cancelled() -> None:
    events: list[str] = []
    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(
        runs_to_the_end(events, seconds=30), exclude=("/payments/",), watch_delay=0
    )
    task = asyncio.create_task(conn.run(middleware, http_scope("POST", "/payment")))
    await until(lambda: events == ["started"])
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["started"]


@pytest.mark.parametrize("exclude", [(), ("payments",), 42, [b"/x"]], ids=repr)
def test_invalid_exclude_rejected(exclude: Any) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pass  # pragma: no cover

    with pytest.raises(ValueError, match=r"^exclude must be"):
        CancelOnDisconnectMiddleware(app, exclude=exclude)


async def test_detached_handler_runs_to_the_end_while_its_token_reports_the_disconnect() -> None:
    events: list[str] = []
    hook_calls: list[dict[str, Any]] = []

    @detach()
    async def endpoint() -> None:
        token = current_token()
        token.on_cancel(lambda: events.append("token fired"))
        events.append("started")
        await asyncio.sleep(0.2)
        with shield():  # a shield's exit inside a detached request cancels nothing either
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        events.append(f"finished cancelled={token.cancelled} detached={token.detached}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await endpoint()
        await respond(send)

    def hook(scope: Scope, **info: Any) -> None:
        hook_calls.append(info)

    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(app, on_cancelled=hook, watch_delay=0)
    task = asyncio.create_task(conn.run(middleware, http_scope("POST", "/payments")))
    await until(lambda: events == ["started"])
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["started", "token fired", "finished cancelled=True detached=True"]
    assert len(hook_calls) == 1
    assert hook_calls[0]["response_started"] is False


async def test_detach_as_a_context_manager_and_on_a_sync_function() -> None:
    events: list[str] = []

    @detach()
    def sync_part() -> bool:
        return current_token().detached

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert not current_token().detached
        with detach() as token:
            assert token is current_token()
            events.append("started")
            await asyncio.sleep(0.1)
        events.append(f"sync detached={sync_part()}")
        await respond(send)

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app, watch_delay=0)))
    await until(lambda: events == ["started"])
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["started", "sync detached=True"]


def test_detach_outside_a_request_does_nothing() -> None:
    with detach() as token:
        assert token is None
