"""Cancel by id: `CancelRegistry`, the middleware's `registry=` option and `cancel_endpoint`."""

from __future__ import annotations

import json
import threading
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

from .helpers import QueueServer, respond, running, slow_app, until, with_watchdog
from .test_request_ids import ids_in, response_headers, with_header

pytestmark = pytest.mark.anyio


def tracked_app(events: list[str], *, stream: bool = False) -> ASGIApp:
    """Records its id, then sleeps (or streams) until cancelled, as `slow_app` records."""
    record_id = lambda: events.append(f"id:{current_token().request_id}")  # noqa: E731
    return slow_app(events, stream=stream, callback=True, first=record_id)


@pytest.mark.parametrize("from_thread", [False, True], ids=["in-the-loop", "from-a-thread"])
async def test_cancel_by_id_before_the_response_answers_499(from_thread: bool) -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(tracked_app(events), registry=registry)
    results: list[bool] = []
    async with running(middleware, with_header(b"abc")) as conn:
        await until(lambda: "abc" in registry)
        if from_thread:
            thread = threading.Thread(target=lambda: results.append(registry.cancel("abc")))
            thread.start()
            await until(lambda: not thread.is_alive())
        else:
            results.append(registry.cancel("abc"))
        assert registry.cancel("abc") is False  # twice: a no-op
    assert results == [True]
    assert events == ["id:abc", "body:", "callback:cancelled by id", "cancelled"]
    assert conn.status == 499
    assert json.loads(conn.body) == {"error": "cancelled by id"}
    assert conn.response_complete
    assert "abc" not in registry
    assert len(registry) == 0
    assert registry.cancel("abc") is False  # finished
    assert CancelRegistry().cancel("nope") is False  # unknown


async def test_cancel_by_id_mid_stream_ends_the_stream_cleanly() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(tracked_app(events, stream=True), registry=registry)
    async with running(middleware, with_header(b"s1")) as conn:
        await conn.wait_for_body_chunks(1)
        assert registry.cancel("s1", reason="stopped by user") is True
    assert events == ["id:s1", "body:", "callback:stopped by user", "cancelled"]
    assert conn.status == 200
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert conn.body == b"x"


@pytest.mark.parametrize("disconnect_after_response", [True, False], ids=["finished", "complete"])
async def test_a_finished_or_complete_request_is_not_cancelled(
    disconnect_after_response: bool,
) -> None:
    """Finished, it left the registry; complete, work after the response is not cancelled."""
    registry = CancelRegistry()
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_token().request_id)
        await anyio.lowlevel.checkpoint()
        await respond(send)
        seen.append(registry.cancel("bg"))

    conn = ClientConnection(disconnect_after_response=disconnect_after_response)
    await with_watchdog(
        conn.run(CancelOnDisconnectMiddleware(app, registry=registry), with_header(b"bg"))
    )
    assert seen == ["bg", False]
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]
    assert registry.cancel("bg") is False


async def test_an_id_reused_by_two_running_requests_cancels_both() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(tracked_app(events), registry=registry)
    async with running(middleware, with_header(b"dup")) as first:
        async with running(middleware, with_header(b"dup")) as second:
            await until(lambda: events.count("body:") == 2)
            assert registry.cancel("dup") is True
    assert events.count("cancelled") == 2
    assert first.status == second.status == 499
    assert len(registry) == 0


async def test_a_disconnected_request_is_not_cancelled_again_by_id() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(tracked_app(events), registry=registry, watch_delay=0)
    async with running(middleware, with_header(b"gone")) as conn:
        await until(lambda: "gone" in registry)
        conn.disconnect()
        await until(lambda: "cancelled" in events)
        assert registry.cancel("gone") is False
    assert events == ["id:gone", "body:", "callback:client disconnected", "cancelled"]


def test_the_endpoint_secret_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="secret"):
        require_header("x-cancel-secret", "")


# -- the HTTP endpoint ------------------------------------------------------------------------
async def called(app: ASGIApp, method: str, path: str, headers: Any = ()) -> ClientConnection:
    conn = ClientConnection()
    scope = http_scope(method, path, headers=list(headers))
    scope["root_path"] = "/v1/requests"
    await conn.run(app, scope)
    return conn


async def call(app: ASGIApp, method: str, path: str, headers: Any = ()) -> Any:
    conn = await called(app, method, path, headers)
    return conn.status, json.loads(conn.body)


@pytest.mark.parametrize(
    ("method", "path", "reuse"),
    [
        ("POST", "/v1/requests/r1/cancel", False),
        ("DELETE", "/v1/requests/r1", False),
        ("POST", "/v1/requests/r1/cancel", True),
    ],
    ids=["POST-cancel", "DELETE", "reusing-the-id-it-cancels"],
)
async def test_the_endpoint_cancels_a_running_request(method: str, path: str, reuse: bool) -> None:
    """`reuse`: a client that reuses its correlation id on the cancel call. The endpoint, behind
    the same middleware, is registered under it too: it stops the other request, not itself."""
    events: list[str] = []
    registry = CancelRegistry()
    middleware = CancelOnDisconnectMiddleware(tracked_app(events), registry=registry)
    authorize = require_header("x-cancel-secret", "s3cret")
    endpoint: ASGIApp = cancel_endpoint(registry, authorize=authorize)
    secret = [(b"x-cancel-secret", b"s3cret")]
    own_id = [(b"x-request-id", b"r1")] if reuse else []
    if reuse:
        endpoint = CancelOnDisconnectMiddleware(endpoint, registry=registry)
    async with running(middleware, with_header(b"r1")) as conn:
        await until(lambda: "r1" in registry)
        assert await call(endpoint, method, path) == (403, {"error": "forbidden"})
        wrong = [(b"x-cancel-secret", b"nope")]
        assert (await call(endpoint, method, path, wrong))[0] == 403
        assert (await call(endpoint, "GET", path, secret))[0] == 405
        assert "cancelled" not in events  # refused calls stopped nothing
        answer = await call(endpoint, method, path, secret + own_id)
        assert answer == (200, {"id": "r1", "cancelled": True})
    assert conn.status == 499
    assert await call(endpoint, method, path, secret) == (404, {"id": "r1", "cancelled": False})
    assert (await call(endpoint, "POST", "/v1/requests/a/b/c", secret))[0] == 404


async def test_the_endpoint_answers_with_the_id_in_the_registry_header() -> None:
    registry = CancelRegistry(header="X-Correlation-Id")
    endpoint = cancel_endpoint(registry, authorize=None)
    answer = await called(endpoint, "DELETE", "/v1/requests/gone-1")
    assert (answer.status, ids_in(answer, b"x-correlation-id")) == (404, [b"gone-1"])
    refused = await called(endpoint, "DELETE", "/v1/requests/bad%0Aid")
    assert refused.status == 400
    assert ids_in(refused, b"x-correlation-id") == []  # no id echoed


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("POST", "/v1/requests/r1", b"DELETE"),
        ("DELETE", "/v1/requests/r1/cancel", b"POST"),
        ("PUT", "/v1/requests/r1/cancel", b"POST"),
    ],
    ids=["POST-on-the-id", "DELETE-on-cancel", "PUT"],
)
async def test_the_endpoint_says_which_method_a_path_takes(
    method: str, path: str, allowed: bytes
) -> None:
    conn = await called(cancel_endpoint(CancelRegistry(), authorize=None), method, path)
    assert dict(response_headers(conn))[b"allow"] == allowed
    assert (conn.status, json.loads(conn.body)) == (405, {"error": f"use {allowed.decode()}"})


async def test_the_endpoint_mounted_alone_serves_the_lifespan_and_no_websocket() -> None:
    endpoint = cancel_endpoint(CancelRegistry(), authorize=None)
    server = QueueServer({"type": "lifespan.startup"}, {"type": "lifespan.shutdown"})
    await with_watchdog(endpoint({"type": "lifespan"}, server.receive, server.send))
    await with_watchdog(endpoint({"type": "websocket"}, server.receive, server.send))
    assert server.sent == [
        {"type": "lifespan.startup.complete"},
        {"type": "lifespan.shutdown.complete"},
    ]
    assert server.receive_calls == 2  # the websocket was not even received from
