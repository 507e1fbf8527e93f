"""Every HTTP/1.1 server (one process each for the module), the raw probe app, and a client that
really goes away: FIN, RST or half-close, before the response, mid-stream or mid-upload."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled, leave
from .client import CLOSE_KINDS, FIN, RST, close, connect, get, new_id, read_response, send_request
from .latency import Latencies
from .runner import HTTP1_SERVERS, Server, serving

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

UPLOAD_SIZE = 1_000_000
UPLOAD_SENT = 20_000


@pytest.fixture(scope="module", params=HTTP1_SERVERS, ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with serving(request.param, "tests.servers.apps:app", tmp_path_factory) as server:
        yield server


@pytest.mark.parametrize("close_kind", CLOSE_KINDS)
@pytest.mark.parametrize("endpoint", ["slow", "stream"])
def test_request_cancelled_on_close(
    server: Server, endpoint: str, close_kind: str, latencies: Latencies
) -> None:
    rid = new_id()
    stream = endpoint == "stream"
    closed_at, received = leave(
        server, f"/{endpoint}?id={rid}", rid, close_kind=close_kind, stream=stream
    )
    cancelled = assert_cancelled(
        server, rid, closed_at, latencies, endpoint, close=close_kind, response_started=stream
    )
    # Watched without a task where the middleware knows the server's receive() (`HandStepped`,
    # asgi_cancel/_stepped.py), in a task elsewhere: either way the close is seen at once.
    assert cancelled["watcher"] == server.spec.watcher
    if not stream:
        # After a half-close the client still reads. The middleware completes the request with
        # a 499 for any outer middleware waiting for a response: most servers drop it (their
        # client is gone), hypercorn still writes it to a half-closed connection. Never the
        # app's own answer.
        assert received == b"" or received.startswith(b"HTTP/1.1 499 "), received


@pytest.mark.parametrize("client_after_response", ["stays", "closes", "asks-again"])
def test_post_response_work_completes_normal_request(
    server: Server, client_after_response: str, latencies: Latencies
) -> None:
    # Every h1 server sends http.disconnect right after a normal response, and here the client
    # may also close at once, or send a second request on the connection (keep-alive), which
    # its close then cancels: none of this is the first request's client leaving early, and
    # its post-response work must not be cancelled, nor disturb the second request.
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}&work=0.3")
        response = read_response(sock)
        assert (response.status, response.body) == (200, b"bg")
        if client_after_response == "closes":
            close(sock, FIN)
        elif client_after_response == "asks-again":
            second = new_id()
            send_request(sock, "GET", f"/slow?id={second}")
            server.events.wait_for(second, "start", timeout=WATCHDOG)
            closed_at = close(sock, FIN)
            assert_cancelled(server, second, closed_at, latencies, "keepalive-second")
        bg_done = assert_not_cancelled(server, rid, finished="bg_done")
    assert bg_done["token_cancelled"] is False


def test_server_serves_normal_request_after_cancel(server: Server, latencies: Latencies) -> None:
    rid = new_id()
    closed_at, _ = leave(server, f"/slow?id={rid}", rid)
    assert_cancelled(server, rid, closed_at, latencies, "slow")
    normal = new_id()
    response = get(server.port, f"/slow?id={normal}&t=0.05")
    assert (response.status, response.body) == (200, b"slow done")
    assert_not_cancelled(server, normal, finished="done")
    # The middleware's one INFO line per cancelled request reached the server's log.
    assert re.search(
        r"GET /slow cancelled after [0-9.]+s before the response: client disconnected \(499\)",
        server.log(),
    )


@pytest.mark.parametrize("app_reads_body", [True, False], ids=["app-reads-body", "app-sleeps"])
@pytest.mark.parametrize("close_kind", [FIN, RST])
def test_upload_cancelled_on_close_mid_body(
    server: Server, close_kind: str, app_reads_body: bool, latencies: Latencies
) -> None:
    rid = new_id()
    with connect(server.port) as sock:
        target = f"/upload?id={rid}&read={int(app_reads_body)}"
        headers = (("Content-Length", str(UPLOAD_SIZE)),)
        send_request(sock, "POST", target, headers=headers, body=b"x" * UPLOAD_SENT)
        if server.spec.buffers_request_body:
            # daphne: Twisted buffers the whole body before it calls the app, so the app never
            # starts and there is nothing to cancel. Check that it stays that way: a request
            # sent after the close is served, and this one still has no event.
            time.sleep(0.3)
            close(sock, close_kind)
            assert get(server.port, "/hello").body == b"hello"
            assert server.events.of(rid) == []
            return
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        if app_reads_body:
            server.events.wait_for(
                rid, "received", timeout=WATCHDOG, where=lambda e: e["received"] >= UPLOAD_SENT
            )
        else:
            time.sleep(0.1)  # the middleware reads ahead while the app sleeps
        closed_at = close(sock, close_kind)
    scenario = "upload-" + ("reading" if app_reads_body else "sleeping")
    assert_cancelled(server, rid, closed_at, latencies, scenario, close=close_kind)
    assert not server.events.of(rid, "disconnect_message")
