"""Deadlines: `timeout=`, `timeouts=` per route and the `timeout_header=` budget."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, current_token
from asgi_cancel._tracking import parse_duration
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

pytestmark = pytest.mark.anyio

WATCHDOG = 5.0


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


def slow_app(events: list[str], *, stream: bool = False, seconds: float = 30.0) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        token.on_cancel(lambda: events.append(f"callback:{token.reason}"))
        await receive()
        try:
            if stream:
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise
        events.append("finished")
        if not stream:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def run(app: ASGIApp, scope: Scope | None = None) -> ClientConnection:
    conn = ClientConnection()
    with anyio.fail_after(WATCHDOG):
        await conn.run(app, scope or http_scope())
    return conn


def timed(value: bytes, path: str = "/") -> Scope:
    return http_scope("GET", path, headers=[(b"x-request-timeout", value)])


async def test_a_passed_deadline_answers_504() -> None:
    events: list[str] = []
    conn = await run(CancelOnDisconnectMiddleware(slow_app(events), timeout=0.05))
    assert events == ["callback:deadline exceeded", "cancelled"]
    assert conn.status == 504
    assert json.loads(conn.body) == {"error": "deadline exceeded"}


async def test_a_passed_deadline_ends_a_started_stream_cleanly() -> None:
    events: list[str] = []
    conn = await run(CancelOnDisconnectMiddleware(slow_app(events, stream=True), timeout=0.05))
    assert events == ["callback:deadline exceeded", "cancelled"]
    assert conn.status == 200
    assert conn.body == b"x"
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_request_within_its_deadline_is_untouched() -> None:
    events: list[str] = []
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_token().remaining())
        await slow_app(events, seconds=0.01)(scope, receive, send)

    conn = await run(CancelOnDisconnectMiddleware(app, timeout=5))
    assert events == ["finished"]
    assert conn.status == 200
    assert 4.5 < seen[0] <= 5


@pytest.mark.parametrize(
    ("header", "status"),
    [(b"50ms", 504), (b"0.05", 504), (b"0.05s", 504), (b"1m", 200)],
    ids=["ms", "plain", "s", "minutes"],
)
async def test_the_header_sets_the_deadline(header: bytes, status: int) -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(
        slow_app(events, seconds=0.3), timeout_header="X-Request-Timeout"
    )
    conn = await run(app, timed(header))
    assert conn.status == status


async def test_the_header_cannot_extend_the_configured_deadline() -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(
        slow_app(events), timeout=0.05, timeout_header="x-request-timeout"
    )
    conn = await run(app, timed(b"60s"))
    assert conn.status == 504


@pytest.mark.parametrize("header", [b"soon", b"-5", b"5h", b"", b"1e3"])
async def test_a_malformed_header_is_400_and_the_app_never_runs(header: bytes) -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(slow_app(events), timeout_header="x-request-timeout")
    conn = await run(app, timed(header))
    assert conn.status == 400
    assert "malformed x-request-timeout header" in json.loads(conn.body)["error"]
    assert events == []


async def test_no_budget_left_is_504_and_the_app_never_runs() -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(slow_app(events), timeout_header="x-request-timeout")
    conn = await run(app, timed(b"0ms"))
    assert conn.status == 504
    assert events == []


async def test_per_route_deadlines_by_prefix() -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(
        slow_app(events, seconds=0.2),
        timeout=0.05,
        timeouts={"/v1/": 10, "/v1/fast": 0.05, "/stream": None},
    )
    assert (await run(app, http_scope(path="/v1/completions"))).status == 200
    assert (await run(app, http_scope(path="/v1/fast/x"))).status == 504
    assert (await run(app, http_scope(path="/stream"))).status == 200  # None: no deadline
    assert (await run(app, http_scope(path="/other"))).status == 504  # the default


async def test_per_route_deadlines_by_callable() -> None:
    events: list[str] = []

    def timeouts(scope: Scope) -> float | None:
        return 0.05 if scope["path"] == "/short" else None

    app = CancelOnDisconnectMiddleware(slow_app(events, seconds=0.2), timeouts=timeouts)
    assert (await run(app, http_scope(path="/short"))).status == 504
    assert (await run(app, http_scope(path="/long"))).status == 200


async def test_a_hello_world_with_a_deadline_completes() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hi"})

    conn = await run(CancelOnDisconnectMiddleware(app, timeout=0.05))
    assert conn.status == 200
    await anyio.sleep(0.1)  # the timer was cancelled with the request: nothing fires late
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_app_that_reacts_itself_gets_no_second_cancel(anyio_backend: str) -> None:
    """An app listening for http.disconnect (Starlette's stream below spec 2.4) gets it."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body
        await anyio.sleep(0.01)  # meanwhile the watcher holds the server's receive
        message = await receive()  # listens: the deadline's stop delivers http.disconnect
        events.append(message["type"])
        try:
            await anyio.sleep(0.02)  # its own cleanup, uncancelled
            events.append("cleanup done")
        except anyio.get_cancelled_exc_class():  # pragma: no cover - a second cancel
            events.append("cancelled during cleanup")
            raise

    # watch_delay=0: the watcher holds the server's receive and the app waits behind it, where
    # the stop can reach it (an app holding the server's receive itself is cancelled after `grace`).
    conn = await run(CancelOnDisconnectMiddleware(app, timeout=0.05, grace=1, watch_delay=0))
    assert events == ["http.disconnect", "cleanup done"]
    assert conn.status == 504


def test_parse_duration() -> None:
    assert parse_duration("30") == 30
    assert parse_duration(" 1.5 ") == 1.5
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120
    assert parse_duration(".5s") == 0.5
    assert parse_duration("5 h") is None
    assert parse_duration("nan") is None


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("timeout", 0),
        ("timeout", -1),
        ("timeout", float("inf")),
        ("timeout", "30s"),
        ("timeouts", 5),
        ("timeouts", {"/x": -1}),
        ("timeout_header", ""),
    ],
)
def test_bad_deadline_options_are_value_errors(option: str, value: Any) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pass  # pragma: no cover

    with pytest.raises(ValueError, match=rf"^{option}"):
        CancelOnDisconnectMiddleware(app, **{option: value})
