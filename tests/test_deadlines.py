"""Deadlines: `timeout=`, `timeouts=` per route and the `timeout_header=` budget."""

from __future__ import annotations

import json

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token, detach
from asgi_cancel.testing import http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import respond, served, slow_app

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [False, True], ids=["before-the-response", "mid-stream"])
async def test_a_passed_deadline_answers_504_or_ends_a_started_stream_cleanly(stream: bool) -> None:
    events: list[str] = []
    app = slow_app(events, stream=stream, callback=True)
    conn = await served(CancelOnDisconnectMiddleware(app, timeout=0.05))
    assert events == ["body:", "callback:deadline exceeded", "cancelled"]
    if stream:
        assert (conn.status, conn.body) == (200, b"x")
        assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    else:
        assert (conn.status, json.loads(conn.body)) == (504, {"error": "deadline exceeded"})


@pytest.mark.parametrize("stopped_by", ["deadline", "cancel by id"])
async def test_a_detached_request_runs_to_its_end_and_its_client_gets_its_response(
    stopped_by: str,
) -> None:
    """A payment endpoint under `detach()`: neither its deadline nor a cancel by id stops it
    (the cancel answers False: nothing was stopped), and the client gets the app's answer,
    not a 504 or 499 for work that was done."""
    registry = CancelRegistry()
    events: list[object] = []

    @detach()
    async def pay(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        events.append("charging")
        await anyio.sleep(0.15)  # past the deadline, or the cancel comes meanwhile
        events.append("charged")
        await respond(send, b"paid")

    async def cancel_meanwhile() -> None:
        await anyio.sleep(0.05)
        events.append(("cancel", registry.cancel("pay-1")))

    options = {"timeout": 0.05} if stopped_by == "deadline" else {"registry": registry}
    middleware = CancelOnDisconnectMiddleware(pay, **options)
    scope = http_scope("POST", headers=[(b"x-request-id", b"pay-1")])
    async with anyio.create_task_group() as tasks:
        if stopped_by == "cancel by id":
            tasks.start_soon(cancel_meanwhile)
        conn = await served(middleware, scope)
    cancelled = [("cancel", False)] if stopped_by == "cancel by id" else []
    assert events == ["charging", *cancelled, "charged"]
    assert (conn.status, conn.body) == (200, b"paid")


async def test_a_stream_that_ends_itself_at_the_deadline_is_still_cut_visibly() -> None:
    """An app that listens (Starlette's stream below spec 2.4) ends its own stream when the
    deadline's disconnect reaches it: its closing messages are dropped like the rest, so the
    client gets the SSE error event and the end from the middleware, never a silent close."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        assert (await receive())["type"] == "http.disconnect"  # the deadline
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    conn = await served(CancelOnDisconnectMiddleware(app, timeout=0.05))
    assert conn.status == 200
    assert conn.body.startswith(b"data: 1\n\nevent: error\n")
    assert b"[DONE]" not in conn.body
    assert conn.response_complete


@pytest.mark.parametrize(
    ("configured", "header", "status", "app_runs"),
    [
        # (Every format accepted or refused: test_tracking.py's parse table.)
        (None, b"50ms", 504, True),
        (None, b"1m", 200, True),
        (0.05, b"60s", 504, True),  # the header cannot extend the configured deadline
        (None, b"0ms", 504, False),  # no budget left
        *((None, malformed, 400, False) for malformed in (b"soon", b"")),
    ],
)
async def test_the_header_sets_the_deadline(
    configured: float | None, header: bytes, status: int, app_runs: bool
) -> None:
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(
        slow_app(events, seconds=5 if status == 504 else 0.3),  # 5: cut short by the deadline
        timeout=configured,
        timeout_header="X-Request-Timeout",
    )
    conn = await served(app, http_scope(headers=[(b"x-request-timeout", header)]))
    assert conn.status == status
    assert (events != []) is app_runs
    if status == 400:
        assert "malformed x-request-timeout header" in json.loads(conn.body)["error"]


async def test_per_route_deadlines_by_prefix_or_callable() -> None:
    expected = {"/v1/completions": 200, "/v1/fast/x": 504, "/stream": 200, "/other": 504}
    expected |= {"/short": 504, "/long": 200}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # Longer than the 0.05 s deadlines, or much longer where one must end it: a loaded
        # machine's stall must not let the app finish first.
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        seconds = 5 if expected[path] == 504 else 0.2
        await slow_app([], seconds=seconds)(scope, receive, send)

    prefixed = CancelOnDisconnectMiddleware(
        app, timeout=0.05, timeouts={"/v1/": 10, "/v1/fast": 0.05, "/stream": None}
    )
    for path in ("/v1/completions", "/v1/fast/x", "/stream", "/other"):  # /other: the default
        assert (await served(prefixed, http_scope(path=path))).status == expected[path], path
        # As uvicorn `--root-path /api` gives it: the prefixes match the path the app routes on.
        rooted = http_scope(path="/api" + path)
        rooted["root_path"] = "/api"
        assert (await served(prefixed, rooted)).status == expected[path], rooted

    def timeouts(scope: Scope) -> float | None:
        return 0.05 if scope["path"] == "/short" else None

    by_callable = CancelOnDisconnectMiddleware(app, timeouts=timeouts)
    for path in ("/short", "/long"):
        assert (await served(by_callable, http_scope(path=path))).status == expected[path], path


async def test_a_request_within_its_deadline_is_untouched() -> None:
    """A hello world that never waits, and one that does: the timer goes with the request."""
    remaining: list[float | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        remaining.append(current_token().remaining())
        if scope["path"] == "/slow":
            await anyio.sleep(0.01)
        await respond(send, b"hi")

    middleware = CancelOnDisconnectMiddleware(app, timeout=0.3)
    connections = [await served(middleware, http_scope(path=path)) for path in ("/", "/slow")]
    await anyio.sleep(0.35)  # nothing fires late
    for conn in connections:
        assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]
        assert conn.status == 200
    assert [left is not None and 0.15 < left <= 0.3 for left in remaining] == [True, True]


@pytest.mark.parametrize("watch_delay", [0, 0.5], ids=["watcher-first", "app-asks-first"])
async def test_an_app_that_reacts_itself_gets_no_second_cancel(watch_delay: float) -> None:
    """An app listening for http.disconnect (Starlette's stream below spec 2.4) gets it, also
    when it asks before the watcher has started (it then waits behind the watcher, which
    starts at once)."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body
        message = await receive()  # listens: the deadline's stop delivers http.disconnect
        events.append(message["type"])
        try:
            await anyio.sleep(0.02)  # its own cleanup, uncancelled
            events.append("cleanup done")
        except anyio.get_cancelled_exc_class():  # pragma: no cover - a second cancel
            events.append("cancelled during cleanup")
            raise

    middleware = CancelOnDisconnectMiddleware(app, timeout=0.3, grace=1, watch_delay=watch_delay)
    conn = await served(middleware)
    assert events == ["http.disconnect", "cleanup done"]
    assert conn.status == 504
