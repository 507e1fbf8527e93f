"""gunicorn 27's native ASGI worker (`-k asgi`) cancels the request task itself.

`--asgi-disconnect-grace-period` (default 3 s) after the client's connection is lost, gunicorn
cancels the app's task if it is still running: a plain app that never looks at `receive()` is
cancelled then, and so is post-response work (Starlette's `BackgroundTasks`) whose client left.
A client that stays connected keeps its post-response work alive. With the middleware, the app
is cancelled within milliseconds of the close, and gunicorn's own cancel later finds nothing.
Only the middleware can say "client disconnected": gunicorn's cancel is a bare `CancelledError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .checks import WATCHDOG, assert_cancelled
from .client import FIN, close, connect, new_id, read_response, send_request
from .latency import Latencies
from .runner import GUNICORN, GUNICORN_GRACE, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

# gunicorn's cancel is a `loop.call_later(grace)`: it comes at the grace period plus a few ms.
SELF_CANCEL_SLACK = 1.0


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """gunicorn serving the probe app without the middleware."""
    workdir: Path = tmp_path_factory.mktemp("gunicorn-bare")
    with running_server(GUNICORN, "servers.probe_app:bare_app", workdir) as server:
        yield server
        server.assert_no_traceback()


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """gunicorn serving the probe app with the middleware."""
    workdir: Path = tmp_path_factory.mktemp("gunicorn-wrapped")
    with running_server(GUNICORN, "servers.probe_app:app", workdir) as server:
        yield server
        server.assert_no_traceback()


def assert_cancelled_by_gunicorn(server: Server, rid: str, *, closed_at: float) -> None:
    """gunicorn itself cancelled the request, its grace period after the close."""
    grace = server.spec.cancels_app_after
    assert grace is not None
    cancelled = server.events.wait_for(rid, "cancelled", timeout=grace + WATCHDOG)
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    latency = cancelled["t"] - closed_at
    # asyncio timers may fire up to the clock resolution early: 50 ms of slack below.
    assert grace - 0.05 <= latency < grace + SELF_CANCEL_SLACK, latency
    assert cancelled["exc"] == "CancelledError"
    # Not the middleware's cancellation: it reached the server as it came.
    assert exit_event["outcome"] == "CancelledError"
    assert not server.events.of(rid, "hook")
    server.assert_no_traceback()


def start_slow_and_post_response_work(server: Server) -> tuple[str, float, str, float]:
    """A slow request, and a complete response whose post-response work outlasts the grace
    period, on two connections; both clients leave at once. Returns each id and its close."""
    slow, bg = new_id(), new_id()
    with connect(server.port) as slow_sock, connect(server.port) as bg_sock:
        send_request(slow_sock, "GET", f"/slow?id={slow}")
        send_request(bg_sock, "GET", f"/bg?id={bg}&work={GUNICORN_GRACE + 10}")
        response = read_response(bg_sock)
        assert (response.status, response.body) == (200, b"bg")
        server.events.wait_for(slow, "start", timeout=WATCHDOG)
        bg_closed_at = close(bg_sock, FIN)
        slow_closed_at = close(slow_sock, FIN)
    return slow, slow_closed_at, bg, bg_closed_at


def test_gunicorn_cancels_bare_app_after_grace_period(bare: Server) -> None:
    # Without the middleware: the slow request and the post-response work run on for the
    # whole grace period, then gunicorn cancels both.
    slow, slow_closed_at, bg, bg_closed_at = start_slow_and_post_response_work(bare)
    for rid, closed_at in ((slow, slow_closed_at), (bg, bg_closed_at)):
        assert_cancelled_by_gunicorn(bare, rid, closed_at=closed_at)
        assert bare.events.of(rid, "cancelled")[0]["token_cancelled"] is None  # no middleware
    assert not bare.events.of(bg, "bg_done")


def test_middleware_cancels_long_before_gunicorn(wrapped: Server, latencies: Latencies) -> None:
    # With the middleware: the slow request is cancelled within milliseconds. Post-response
    # work is not the middleware's to cancel, and it cannot stop gunicorn from doing so.
    slow, closed_at, bg, bg_closed_at = start_slow_and_post_response_work(wrapped)
    cancelled = assert_cancelled(
        wrapped,
        slow,
        closed_at=closed_at,
        response_started=False,
        latencies=latencies,
        scenario="slow",
        close=FIN,
    )
    assert cancelled["t"] - closed_at < GUNICORN_GRACE / 2
    assert_cancelled_by_gunicorn(wrapped, bg, closed_at=bg_closed_at)
    assert wrapped.events.of(bg, "cancelled")[0]["token_cancelled"] is False
    assert not wrapped.events.of(bg, "bg_done")
    # Past gunicorn's own deadline: the slow request was over, nothing cancelled it again.
    assert len(wrapped.events.of(slow, "cancelled")) == 1
    assert len(wrapped.events.of(slow, "exit")) == 1
    assert len(wrapped.events.of(slow, "hook")) == 1
    wrapped.assert_no_traceback()


def test_post_response_work_longer_than_grace_survives_connected_client(wrapped: Server) -> None:
    # gunicorn counts from the close, not from the end of the response (daphne does): a client
    # that stays connected keeps post-response work alive past the grace period.
    rid = new_id()
    with connect(wrapped.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}&work={GUNICORN_GRACE + 0.5}")
        response = read_response(sock)
        assert (response.status, response.body) == (200, b"bg")
        bg_done = wrapped.events.wait_for(rid, "bg_done", timeout=GUNICORN_GRACE + WATCHDOG)
        close(sock, FIN)
    assert bg_done["token_cancelled"] is False
    exit_event = wrapped.events.wait_for(rid, "exit", timeout=WATCHDOG)
    assert exit_event["outcome"] == "returned"
    assert not wrapped.events.of(rid, "cancelled")
    assert not wrapped.events.of(rid, "hook")
    wrapped.assert_no_traceback()
