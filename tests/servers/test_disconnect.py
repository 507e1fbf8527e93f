"""Every HTTP/1.1 server, the raw probe app, and a client that really goes away.

One server process per parametrized server, for the whole module. Latency is the app's
`CancelledError` minus the client's close, both `time.monotonic()` (one clock on Linux).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled
from .client import (
    CHUNK_MARKER,
    CLOSE_KINDS,
    FIN,
    HALF,
    RST,
    close,
    connect,
    get,
    new_id,
    read_head,
    read_response,
    read_to_eof,
    read_until_count,
    send_request,
)
from .latency import Latencies
from .runner import HTTP1_SERVERS, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

UPLOAD_SIZE = 1_000_000
UPLOAD_SENT = 20_000


@pytest.fixture(scope="module", params=HTTP1_SERVERS, ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir: Path = tmp_path_factory.mktemp(request.param.name)
    with running_server(request.param, "servers.probe_app:app", workdir) as server:
        yield server
        server.assert_no_traceback()


@pytest.mark.parametrize("close_kind", CLOSE_KINDS)
def test_slow_request_cancelled_on_close(
    server: Server, close_kind: str, latencies: Latencies
) -> None:
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/slow?id={rid}")
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, close_kind)
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario="slow",
            close=close_kind,
        )
        if close_kind == HALF:
            # Still reading. The middleware completes the request with a 499 for any outer
            # middleware waiting for a response: most servers drop it (their client is gone),
            # hypercorn still writes to a half-closed connection. Never the app's own answer.
            received = read_to_eof(sock)
            assert received == b"" or received.startswith(b"HTTP/1.1 499 "), received


@pytest.mark.parametrize("close_kind", CLOSE_KINDS)
def test_streaming_response_cancelled_on_close(
    server: Server, close_kind: str, latencies: Latencies
) -> None:
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/stream?id={rid}")
        status, _, body = read_head(sock)
        assert status == 200
        read_until_count(sock, CHUNK_MARKER, 3, body)
        closed_at = close(sock, close_kind)
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=True,
            latencies=latencies,
            scenario="stream",
            close=close_kind,
        )


@pytest.mark.parametrize("client_after_response", ["stays", "closes"])
def test_post_response_work_completes_normal_request(
    server: Server, client_after_response: str
) -> None:
    # Every h1 server sends http.disconnect right after a normal response, and here the client
    # may also close at once: neither is a client leaving early, nothing may be cancelled.
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}&work=0.3")
        response = read_response(sock)
        if client_after_response == "closes":
            close(sock, FIN)
        assert (response.status, response.body) == (200, b"bg")
        bg_done = assert_not_cancelled(server, rid, finished="bg_done")
    assert bg_done["token_cancelled"] is False


def test_server_serves_normal_request_after_cancel(server: Server, latencies: Latencies) -> None:
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/slow?id={rid}")
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, FIN)
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario="slow",
            close=FIN,
        )
    normal = new_id()
    response = get(server.port, f"/slow?id={normal}&t=0.05")
    assert (response.status, response.body) == (200, b"slow done")
    assert_not_cancelled(server, normal, finished="done")
    # The middleware's one INFO line per cancelled request reached the server's log.
    assert re.search(
        r"GET /slow cancelled after [0-9.]+s before the response: client disconnected \(499\)",
        server.log(),
    )


def test_keepalive_next_request_cancelled_on_close(server: Server, latencies: Latencies) -> None:
    # Two requests on one connection: the first one's end-of-response disconnect and its
    # post-response work must not disturb the second, which the close then cancels.
    first, second = new_id(), new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={first}&work=0.3")
        response = read_response(sock)
        assert (response.status, response.body) == (200, b"bg")
        send_request(sock, "GET", f"/slow?id={second}")
        server.events.wait_for(second, "start", timeout=WATCHDOG)
        closed_at = close(sock, FIN)
        assert_cancelled(
            server,
            second,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario="keepalive-second",
            close=FIN,
        )
    bg_done = assert_not_cancelled(server, first, finished="bg_done")
    assert bg_done["token_cancelled"] is False


@pytest.mark.parametrize("app_reads_body", [True, False], ids=["app-reads-body", "app-sleeps"])
@pytest.mark.parametrize("close_kind", [FIN, RST])
def test_upload_cancelled_on_close_mid_body(
    server: Server, close_kind: str, app_reads_body: bool, latencies: Latencies
) -> None:
    rid = new_id()
    read = int(app_reads_body)
    with connect(server.port) as sock:
        send_request(
            sock,
            "POST",
            f"/upload?id={rid}&read={read}",
            headers=(("Content-Length", str(UPLOAD_SIZE)),),
            body=b"x" * UPLOAD_SENT,
        )
        if server.spec.buffers_request_body:
            # daphne: Twisted buffers the whole body before it calls the app, so the app never
            # starts and there is nothing to cancel. Check that it stays that way.
            time.sleep(0.3)
            close(sock, close_kind)
            time.sleep(0.5)
            assert server.events.of(rid) == []
            server.assert_no_traceback()
            return
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        if app_reads_body:
            server.events.wait_for(
                rid, "received", timeout=WATCHDOG, where=lambda e: e["received"] >= UPLOAD_SENT
            )
        else:
            time.sleep(0.1)  # the middleware reads ahead while the app sleeps
        closed_at = close(sock, close_kind)
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario="upload-" + ("reading" if app_reads_body else "sleeping"),
            close=close_kind,
        )
    assert not server.events.of(rid, "disconnect_message")
