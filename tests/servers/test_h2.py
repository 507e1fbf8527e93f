"""hypercorn and gunicorn over HTTP/2 (h2c with prior knowledge): a reset stream is cancelled,
its siblings on the same connection complete; a closed connection cancels every stream on it.

After the TCP connection is gone, hypercorn's h2 `send(http.response.body)` hangs forever;
the middleware drops sends after the disconnect and cancels the app, which frees the task.
gunicorn's h2 `send()` after an RST_STREAM raises `ClientDisconnected`; the middleware drops
it too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled
from .client import FIN, close, connect, new_id
from .h2_client import H2Client
from .latency import Latencies
from .runner import GUNICORN_H2, HYPERCORN_ASYNCIO, HYPERCORN_TRIO, Server, serving

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]


@pytest.fixture(scope="module", params=[HYPERCORN_ASYNCIO, HYPERCORN_TRIO, GUNICORN_H2], ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with serving(request.param, "tests.servers.apps:app", tmp_path_factory) as server:
        yield server


@pytest.mark.parametrize("endpoint", ["slow", "stream"])
def test_h2_stream_reset_cancels_only_that_stream(
    server: Server, endpoint: str, latencies: Latencies
) -> None:
    doomed, sibling = new_id(), new_id()
    with connect(server.port) as sock:
        client = H2Client(sock, server.port)
        doomed_stream = client.get(f"/{endpoint}?id={doomed}")
        sibling_stream = client.get(f"/slow?id={sibling}&t=0.5")
        server.events.wait_for(doomed, "start", timeout=WATCHDOG)
        server.events.wait_for(sibling, "start", timeout=WATCHDOG)
        reset_at = client.reset_stream(doomed_stream)
        started = endpoint == "stream"
        assert_cancelled(
            server, doomed, reset_at, latencies, f"h2-{endpoint}", close="rst-stream",
            response_started=started,
        )  # fmt: skip
        # The sibling stream on the same connection is untouched and completes.
        client.read_until_ended(sibling_stream)
        assert client.status[sibling_stream] == 200
        assert client.body[sibling_stream] == b"slow done"
        assert_not_cancelled(server, sibling, finished="done")


def test_h2_connection_close_cancels_every_stream(server: Server, latencies: Latencies) -> None:
    slow, stream = new_id(), new_id()
    with connect(server.port) as sock:
        client = H2Client(sock, server.port)
        client.get(f"/slow?id={slow}")
        client.get(f"/stream?id={stream}")
        server.events.wait_for(slow, "start", timeout=WATCHDOG)
        server.events.wait_for(stream, "start", timeout=WATCHDOG)
        closed_at = close(sock, FIN)
    for rid, started, scenario in [(slow, False, "h2-slow"), (stream, True, "h2-stream")]:
        assert_cancelled(
            server, rid, closed_at, latencies, scenario, close="conn-fin", response_started=started
        )


def test_h2_connection_close_during_the_final_send(server: Server, latencies: Latencies) -> None:
    """No flow-control window: the final body waits in the server's buffer, then the client
    closes. hypercorn never returns that send (its sender task stops with the connection):
    without the middleware the app task waits in it forever (the soak found ~30 per 200 h2c
    requests). The middleware sees the send in flight `grace` after the disconnect and cancels
    the app: the response never reached the client."""
    rid = new_id()
    with connect(server.port) as sock:
        client = H2Client(sock, server.port, window=0)
        client.get(f"/bg?id={rid}&work=0.1")
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        client.read_until(lambda: bool(client.status))  # the headers are out, the body is not
        time.sleep(0.05)  # the app is in its final send
        closed_at = close(sock, FIN)
    if server.spec is GUNICORN_H2:
        # Its send raises ClientDisconnected, which the app meets and the server handles.
        exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
        assert exit_event["outcome"] == "ClientDisconnected"
        assert not server.events.of(rid, "hook")
        assert not server.events.of(rid, "bg_done")
        return
    assert_cancelled(
        server, rid, closed_at, latencies, "h2-final-send", close="conn-fin", response_started=True
    )
