"""asgi_cancel.prometheus: counter and cleanup histogram after real cancellations."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.prometheus import CancelMetrics
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import with_watchdog
from .servers.client import (
    CHUNK_MARKER,
    RST,
    close,
    connect,
    get,
    new_id,
    read_head,
    read_response,
    read_to_eof,
    send_request,
)
from .servers.metrics_app import CLEANUP
from .servers.runner import HYPERCORN_TRIO, UVICORN_HTTPTOOLS, Server, ServerSpec, running_server

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


# -- under a real server ------------------------------------------------------------------------
@pytest.fixture(
    scope="module", params=[UVICORN_HTTPTOOLS, HYPERCORN_TRIO], ids=lambda spec: str(spec)
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    spec: ServerSpec = request.param
    workdir: Path = tmp_path_factory.mktemp(f"metrics-{spec}")
    with running_server(spec, "servers.metrics_app:app", workdir) as running:
        yield running


def leave_before_response(server: Server, target: str) -> None:
    with connect(server.port) as sock:
        send_request(sock, "GET", target)
        time.sleep(0.3)  # the app is sleeping in its endpoint
        close(sock, RST)


def leave_mid_stream(server: Server, target: str) -> None:
    with connect(server.port) as sock:
        send_request(sock, "GET", target)
        _, _, body = read_head(sock)
        while CHUNK_MARKER not in body:
            body += sock.recv(65536)
        close(sock, RST)


def wait_for_metrics(server: Server, done: Any) -> Samples:
    deadline = time.monotonic() + 15
    while True:
        found = samples(get(server.port, "/metrics").body.decode())
        if done(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.servers
@pytest.mark.timeout(90)
def test_real_cancellations_counted_once_by_route_template_and_phase(server: Server) -> None:
    for item_id in (1, 2, 3):
        leave_before_response(server, f"/items/{item_id}")
    for name in ("a", "b"):
        leave_mid_stream(server, f"/stream/{name}")
    assert get(server.port, "/payments/7").body == b"paid"  # excluded: not counted

    before = {"method": "GET", "route": "/items/{item_id}", "reason": "client disconnected"}
    stream = {"method": "GET", "route": "/stream/{name}", "reason": "client disconnected"}

    def done(found: Samples) -> bool:
        return (
            value(found, "test_cancel_cleanup_seconds_count", **before, phase="before_response")
            >= 3
            and value(found, "test_cancel_cleanup_seconds_count", **stream, phase="mid_stream") >= 2
        )

    found = wait_for_metrics(server, done)
    time.sleep(0.3)  # anything counted twice would show up by now
    found = samples(get(server.port, "/metrics").body.decode())
    counted = {
        dict(labels)["route"]: count
        for (name, labels), count in found.items()
        if name == "test_cancelled_requests_total"
    }
    assert counted == {"/items/{item_id}": 3, "/stream/{name}": 2}
    assert value(found, "test_cancelled_requests_total", **before, phase="before_response") == 3
    assert value(found, "test_cancelled_requests_total", **stream, phase="mid_stream") == 2
    for labels, phase, count in ((before, "before_response", 3), (stream, "mid_stream", 2)):
        assert value(found, "test_cancel_cleanup_seconds_count", **labels, phase=phase) == count
        total = value(found, "test_cancel_cleanup_seconds_sum", **labels, phase=phase)
        assert CLEANUP * count <= total < (CLEANUP + 2) * count
    server.assert_no_traceback()


def cancel_by_id(server: Server, request_id: str) -> int:
    with connect(server.port) as sock:
        send_request(sock, "POST", f"/requests/{request_id}/cancel")
        return read_response(sock).status


def read_until_marker(sock: socket.socket, body: bytes) -> bytes:
    while CHUNK_MARKER not in body:
        body += sock.recv(65536)
    return body


def assert_cut(sock: socket.socket, body: bytes) -> None:
    """The server closes the connection under the stream: no final chunk, a visible cut."""
    body += read_to_eof(sock)
    assert not body.endswith(b"0\r\n\r\n"), body[-40:]


@pytest.mark.servers
@pytest.mark.timeout(90)
def test_each_reason_counted_once_with_its_phase(server: Server) -> None:
    """Cancelled by id and deadline exceeded, before the response and mid-stream, while the
    client stays connected: each counted once under its reason, and the client gets the
    documented end (499 / 504 / a stream visibly cut)."""
    routes = {"before_response": "/items/{item_id}", "mid_stream": "/stream/{name}"}
    start = samples(get(server.port, "/metrics").body.decode())
    run = new_id()
    with connect(server.port) as sock:  # cancelled by id before the response: 499
        send_request(sock, "GET", "/items/8", headers=(("X-Request-Id", f"{run}-item"),))
        time.sleep(0.3)  # the app is sleeping in its endpoint
        assert cancel_by_id(server, f"{run}-item") == 202
        assert read_response(sock).status == 499
    with connect(server.port) as sock:  # cancelled by id mid-stream: the stream ends
        send_request(sock, "GET", "/stream/e", headers=(("X-Request-Id", f"{run}-stream"),))
        status, _, body = read_head(sock)
        body = read_until_marker(sock, body)
        assert cancel_by_id(server, f"{run}-stream") == 202
        assert status == 200
        assert_cut(sock, body)
    with connect(server.port) as sock:  # deadline before the response: 504
        send_request(sock, "GET", "/items/9", headers=(("X-Request-Timeout", "300ms"),))
        assert read_response(sock).status == 504
    with connect(server.port) as sock:  # deadline mid-stream: the stream ends
        send_request(sock, "GET", "/stream/f", headers=(("X-Request-Timeout", "300ms"),))
        _, _, body = read_head(sock)
        assert_cut(sock, body)
    expected = [
        ("cancelled by id", "before_response"),
        ("cancelled by id", "mid_stream"),
        ("deadline exceeded", "before_response"),
        ("deadline exceeded", "mid_stream"),
    ]

    def count(found: Samples, name: str, reason: str, phase: str) -> float:
        labels = {"method": "GET", "route": routes[phase], "reason": reason, "phase": phase}
        return value(found, name, **labels) - value(start, name, **labels)

    found = wait_for_metrics(
        server,
        lambda found: all(
            count(found, "test_cancel_cleanup_seconds_count", *key) >= 1 for key in expected
        ),
    )
    time.sleep(0.3)  # anything counted twice would show up by now
    found = samples(get(server.port, "/metrics").body.decode())
    for reason, phase in expected:
        assert count(found, "test_cancelled_requests_total", reason, phase) == 1, (reason, phase)
        assert count(found, "test_cancel_cleanup_seconds_count", reason, phase) == 1
    server.assert_no_traceback()


# -- in process ---------------------------------------------------------------------------------
async def slow(request: Request) -> Response:
    await asyncio.sleep(30)
    return PlainTextResponse("late")  # pragma: no cover


async def slow_fallback(scope: Scope, receive: Receive, send: Send) -> None:
    await asyncio.sleep(30)


@pytest.mark.anyio
async def test_cardinality_bounded_under_a_thousand_distinct_paths() -> None:
    registry = CollectorRegistry()
    metrics = CancelMetrics(registry=registry)
    starlette = Starlette(routes=[Route("/users/{user_id}/orders", slow)])
    starlette.router.default = slow_fallback  # what no route matched: no scope["route"]
    app = CancelOnDisconnectMiddleware(
        starlette,
        on_cancelled=metrics,
        watch_delay=0,
    )

    async def cancel_one(path: str, method: str) -> None:
        conn = ClientConnection()
        task = asyncio.create_task(conn.run(app, http_scope(method, path)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        conn.disconnect()
        await with_watchdog(task)

    for n in range(1000):
        await cancel_one(f"/users/{n}/orders", "GET")
        await cancel_one(f"/nowhere/{n}", "BREW" if n % 2 else "GET")
    found = samples(generate_latest(registry).decode())
    series = {labels for (name, labels) in found if name == "asgi_cancel_cancelled_requests_total"}
    assert len(series) == 3
    common = {"reason": "client disconnected", "phase": "before_response"}
    route = "/users/{user_id}/orders"
    assert value(
        found, "asgi_cancel_cancelled_requests_total", method="GET", route=route, **common
    ) == 1000  # fmt: skip
    assert value(
        found, "asgi_cancel_cancelled_requests_total", method="GET", route="unmatched", **common
    ) == 500  # fmt: skip
    assert value(
        found, "asgi_cancel_cancelled_requests_total", method="other", route="unmatched", **common
    ) == 500  # fmt: skip
    assert value(found, "asgi_cancel_cancel_cleanup_seconds_count", method="GET",
                 route="/users/{user_id}/orders", **common) == 1000  # fmt: skip


def test_default_registry_and_one_instance_per_namespace() -> None:
    metrics = CancelMetrics(namespace="asgi_cancel_default_test")
    try:
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            CancelMetrics(namespace="asgi_cancel_default_test")
        finished = metrics(
            http_scope("POST", "/x"), reason="client disconnected", elapsed=0.1,
            response_started=True,
        )  # fmt: skip
        finished()
        labels = {"method": "POST", "route": "unmatched", "reason": "client disconnected",
                  "phase": "mid_stream"}  # fmt: skip
        assert REGISTRY.get_sample_value(
            "asgi_cancel_default_test_cancelled_requests_total", labels
        ) == 1  # fmt: skip
        assert REGISTRY.get_sample_value(
            "asgi_cancel_default_test_cancel_cleanup_seconds_count", labels
        ) == 1  # fmt: skip
    finally:
        REGISTRY.unregister(metrics.cancelled)
        REGISTRY.unregister(metrics.cleanup)
