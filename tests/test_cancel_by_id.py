"""Cancel by id: `CancelRegistry`, the middleware's `registry=` option and `cancel_endpoint`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    cancel_endpoint,
    current_token,
    require_header,
)
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

pytestmark = pytest.mark.anyio

WATCHDOG = 5.0


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


async def until(predicate: Callable[[], bool]) -> None:
    """Yield until `predicate()` holds (the test's `fail_after` is the watchdog)."""
    while True:
        if predicate():
            return
        await anyio.sleep(0.001)


def with_id(request_id: str, path: str = "/") -> Scope:
    return http_scope("GET", path, headers=[(b"x-request-id", request_id.encode())])


def slow_app(events: list[str], *, stream: bool = False) -> ASGIApp:
    """Records its id and callbacks; sleeps (or streams) until cancelled."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        events.append(f"id:{token.request_id}")
        token.on_cancel(lambda: events.append(f"callback:{token.reason}"))
        await receive()
        try:
            if stream:
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise
        events.append("finished")  # pragma: no cover

    return app


async def test_cancel_by_id_before_the_response_answers_499() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry)
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("abc"))
            await until(lambda: "abc" in registry)
            assert registry.cancel("abc") is True
            assert registry.cancel("abc") is False  # twice: a no-op
    assert events == ["id:abc", "callback:cancelled by id", "cancelled"]
    assert conn.status == 499
    assert json.loads(conn.body) == {"error": "cancelled by id"}
    assert conn.response_complete
    assert "abc" not in registry
    assert len(registry) == 0
    assert registry.cancel("abc") is False  # finished


async def test_cancel_by_id_mid_stream_ends_the_stream_cleanly() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events, stream=True), registry=registry)
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("s1"))
            await conn.wait_for_body_chunks(1)
            assert registry.cancel("s1", reason="stopped by user") is True
    assert events == ["id:s1", "callback:stopped by user", "cancelled"]
    assert conn.status == 200
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert conn.body == b"x"


async def test_unknown_id_is_false() -> None:
    assert CancelRegistry().cancel("nope") is False


async def test_a_finished_request_cannot_be_cancelled() -> None:
    registry = CancelRegistry()
    seen: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_token().request_id)
        await anyio.lowlevel.checkpoint()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        await conn.run(CancelOnDisconnectMiddleware(app, registry=registry), with_id("done"))
    assert seen == ["done"]
    assert conn.status == 200
    assert registry.cancel("done") is False


async def test_a_complete_response_is_not_cancelled_by_id() -> None:
    registry = CancelRegistry()
    after: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        after.append(str(registry.cancel("bg")))  # work after the response: not cancelled

    conn = ClientConnection(disconnect_after_response=False)
    with anyio.fail_after(WATCHDOG):
        await conn.run(CancelOnDisconnectMiddleware(app, registry=registry), with_id("bg"))
    assert after == ["False"]
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]


async def test_an_id_reused_by_two_running_requests_cancels_both() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry)
    first, second = ClientConnection(), ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(first.run, middleware, with_id("dup"))
            group.start_soon(second.run, middleware, with_id("dup"))
            await until(lambda: events.count("id:dup") == 2)
            await anyio.sleep(0.01)
            assert registry.cancel("dup") is True
    assert events.count("cancelled") == 2
    assert first.status == second.status == 499
    assert len(registry) == 0


async def test_an_id_is_generated_without_the_header() -> None:
    registry = CancelRegistry()
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_token().request_id)
        seen.append(scope["state"].get("request_id"))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = CancelOnDisconnectMiddleware(app, registry=registry)
    with anyio.fail_after(WATCHDOG):
        await ClientConnection().run(middleware, http_scope())
        await ClientConnection().run(middleware, http_scope())
    first, state, second, _ = seen
    assert isinstance(first, str)
    assert len(first) == 24
    assert state == first
    assert isinstance(second, str)
    assert len(second) == 24
    assert second != first


async def test_a_custom_header_names_the_id() -> None:
    registry = CancelRegistry(header="X-Correlation-Id")
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_token().request_id)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = http_scope(headers=[(b"x-correlation-id", b"corr-1")])
    with anyio.fail_after(WATCHDOG):
        await ClientConnection().run(CancelOnDisconnectMiddleware(app, registry=registry), scope)
    assert seen == ["corr-1"]


async def test_without_a_registry_there_is_no_id() -> None:
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((current_token().request_id, current_token().deadline))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with anyio.fail_after(WATCHDOG):
        await ClientConnection().run(CancelOnDisconnectMiddleware(app), with_id("ignored"))
    assert seen == [(None, None)]


async def test_cancel_from_another_thread() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry)
    conn = ClientConnection()
    results: list[bool] = []
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("t1"))
            await until(lambda: "t1" in registry)
            thread = threading.Thread(target=lambda: results.append(registry.cancel("t1")))
            thread.start()
            await until(lambda: not thread.is_alive())
    assert results == [True]
    assert events == ["id:t1", "callback:cancelled by id", "cancelled"]
    assert conn.status == 499


async def test_a_disconnected_request_is_not_cancelled_again_by_id() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry, watch_delay=0)
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("gone"))
            await until(lambda: "gone" in registry)
            conn.disconnect()
            await until(lambda: "cancelled" in events)
            assert registry.cancel("gone") is False
    assert events == ["id:gone", "callback:client disconnected", "cancelled"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cancel_by_id_waits_for_a_worker_thread(anyio_backend: str) -> None:
    events: list[str] = []
    registry = CancelRegistry()
    release = threading.Event()

    def work() -> None:
        release.wait(WATCHDOG)
        events.append("thread done")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await anyio.to_thread.run_sync(work)
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise

    middleware = CancelOnDisconnectMiddleware(app, registry=registry)
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("th"))
            await until(lambda: "th" in registry)
            await anyio.sleep(0.02)  # the thread runs
            assert registry.cancel("th") is True
            await anyio.sleep(0.05)
            assert events == []  # no unwinding around the running thread
            release.set()
    assert events == ["thread done", "cancelled"]
    assert conn.status == 499


def test_registry_header_must_be_a_name() -> None:
    with pytest.raises(ValueError, match="header"):
        CancelRegistry(header="")


def test_registry_option_must_be_a_registry() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pass  # pragma: no cover

    with pytest.raises(ValueError, match=r"^registry must be"):
        CancelOnDisconnectMiddleware(app, registry="yes")  # type: ignore[arg-type]


# -- the HTTP endpoint ------------------------------------------------------------------------
async def call(app: ASGIApp, method: str, path: str, headers: list[Any] | None = None) -> Any:
    conn = ClientConnection()
    scope = http_scope(method, path, headers=headers or [])
    scope["root_path"] = "/requests"
    await conn.run(app, scope)
    return conn.status, json.loads(conn.body)


async def test_the_endpoint_cancels_a_running_request() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry)
    endpoint = cancel_endpoint(registry, authorize=require_header("x-cancel-secret", "s3cret"))
    secret = [(b"x-cancel-secret", b"s3cret")]
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(conn.run, middleware, with_id("r1"))
            await until(lambda: "r1" in registry)
            assert await call(endpoint, "POST", "/requests/r1/cancel") == (
                403,
                {"error": "forbidden"},
            )
            wrong = [(b"x-cancel-secret", b"nope")]
            assert (await call(endpoint, "DELETE", "/requests/r1", wrong))[0] == 403
            assert (await call(endpoint, "GET", "/requests/r1", secret))[0] == 405
            assert await call(endpoint, "POST", "/requests/r1/cancel", secret) == (
                202,
                {"id": "r1", "cancelled": True},
            )
    assert conn.status == 499
    assert await call(endpoint, "DELETE", "/requests/r1", secret) == (
        404,
        {"id": "r1", "cancelled": False},
    )
    assert (await call(endpoint, "POST", "/requests/a/b/c", secret))[0] == 404


def test_require_header_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        require_header("x-cancel-secret", "")
