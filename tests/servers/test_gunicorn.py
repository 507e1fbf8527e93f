"""gunicorn 27's native ASGI worker (`-k asgi`) cancels the request task itself.

`--asgi-disconnect-grace-period` (default 3 s) after the client's connection is lost, gunicorn
cancels the app's task if it is still running: a plain app that never looks at `receive()` is
cancelled then, and so is post-response work (Starlette's `BackgroundTasks`) whose client left.
A client that stays connected keeps its post-response work alive. With the middleware the app
is cancelled first, by the token, and gunicorn's own cancel later finds nothing. Only the
middleware can say "client disconnected": gunicorn's cancel is a bare `CancelledError`.
Asserted: the order of events, not gunicorn's timer against the clock.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled
from .client import FIN, close, connect, new_id, read_response, send_request
from .events import Event
from .latency import Latencies
from .runner import GUNICORN, GUNICORN_GRACE, Server, serving

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with serving(GUNICORN, f"tests.servers.apps:{request.param}", tmp_path_factory) as server:
        yield server


def gunicorns_cancel(server: Server, rid: str, *, closed_at: float) -> Event:
    """gunicorn itself cancelled the request, after the close: a bare `CancelledError` that
    reached it as it came, no hook (the token did not fire)."""
    cancelled = server.events.wait_for(rid, "cancelled", timeout=GUNICORN_GRACE + WATCHDOG)
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    assert closed_at < cancelled["t"] <= exit_event["t"]
    assert cancelled["exc"] == "CancelledError"
    assert exit_event["outcome"] == "CancelledError"
    assert not server.events.of(rid, "hook")
    assert not server.events.of(rid, "bg_done")
    server.assert_no_traceback()
    return cancelled


def start_slow_and_post_response_work(
    server: Server, slow_sock: socket.socket, bg_sock: socket.socket
) -> tuple[str, str]:
    """A slow request, and a complete response whose post-response work outlasts the grace
    period, on two connections. Returns their ids."""
    slow, bg = new_id(), new_id()
    send_request(slow_sock, "GET", f"/slow?id={slow}")
    send_request(bg_sock, "GET", f"/bg?id={bg}&work={GUNICORN_GRACE + 10}")
    response = read_response(bg_sock)
    assert (response.status, response.body) == (200, b"bg")
    server.events.wait_for(slow, "start", timeout=WATCHDOG)
    return slow, bg


@pytest.mark.parametrize("server", ["bare_app"], indirect=True)
def test_gunicorn_cancels_bare_app_itself(server: Server) -> None:
    # Without the middleware gunicorn cancels both, the slow request and the post-response work.
    with connect(server.port) as slow_sock, connect(server.port) as bg_sock:
        slow, bg = start_slow_and_post_response_work(server, slow_sock, bg_sock)
        closes = {slow: close(slow_sock, FIN), bg: close(bg_sock, FIN)}
    for rid, closed_at in closes.items():
        assert gunicorns_cancel(server, rid, closed_at=closed_at)["token_cancelled"] is None


@pytest.mark.parametrize("server", ["app"], indirect=True)
def test_middleware_cancels_before_gunicorn(server: Server, latencies: Latencies) -> None:
    with connect(server.port) as slow_sock, connect(server.port) as bg_sock:
        slow, bg = start_slow_and_post_response_work(server, slow_sock, bg_sock)
        # The slow request's client leaves: the app sees the middleware's cancellation, with
        # the token's reason (were gunicorn's the first, the token would not have fired and
        # the CancelledError would reach gunicorn).
        ours = assert_cancelled(server, slow, close(slow_sock, FIN), latencies, "slow")
        # Then the post-response work's client leaves. That work is not the middleware's to
        # cancel: gunicorn cancels it, once its timer for that close fires.
        theirs = gunicorns_cancel(server, bg, closed_at=close(bg_sock, FIN))
    assert ours["t"] < theirs["t"]
    assert theirs["token_cancelled"] is False
    # gunicorn's timer for the slow request was set at its close, before the one for `bg`, so it
    # has fired by now: it found the request over, and nothing cancelled it again.
    for event in ("cancelled", "exit", "hook"):
        assert len(server.events.of(slow, event)) == 1, server.events.of(slow)
    server.assert_no_traceback()


@pytest.mark.parametrize("server", ["app"], indirect=True)
def test_post_response_work_longer_than_grace_survives_connected_client(server: Server) -> None:
    # gunicorn counts from the close, not from the end of the response (daphne does): a client
    # that stays connected keeps post-response work alive past the grace period.
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}&work={GUNICORN_GRACE + 0.5}")
        response = read_response(sock)
        assert (response.status, response.body) == (200, b"bg")
        server.events.wait_for(rid, "bg_done", timeout=GUNICORN_GRACE + WATCHDOG)
        close(sock, FIN)
    assert assert_not_cancelled(server, rid, finished="bg_done")["token_cancelled"] is False
