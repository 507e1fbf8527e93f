"""hypercorn and gunicorn over HTTP/2 (h2c with prior knowledge): a reset stream is cancelled,
its siblings on the same connection complete; a closed connection cancels every stream on it.

After the TCP connection is gone, hypercorn's h2 `send(http.response.body)` hangs forever;
the middleware drops sends after the disconnect and cancels the app, which frees the task.
gunicorn's h2 `send()` after an RST_STREAM raises `ClientDisconnected`; the middleware drops
it too.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled
from .client import FIN, HOST, close, connect, new_id
from .latency import Latencies
from .runner import GUNICORN_H2, HYPERCORN_ASYNCIO, HYPERCORN_TRIO, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]


@pytest.fixture(scope="module", params=[HYPERCORN_ASYNCIO, HYPERCORN_TRIO, GUNICORN_H2], ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir: Path = tmp_path_factory.mktemp(request.param.name + "-h2")
    with running_server(request.param, "servers.probe_app:app", workdir) as server:
        yield server
        server.assert_no_traceback()


class H2Client:
    """Just enough of an h2c client: requests, resets, and reading one stream to its end."""

    def __init__(self, sock: socket.socket, port: int, *, window: int | None = None) -> None:
        self.sock = sock
        self.authority = f"{HOST}:{port}"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        if window is not None:  # the server may send this many body bytes per stream
            self.conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
            )
        self.conn.initiate_connection()
        self.flush()
        self.status: dict[int, int] = {}
        self.body: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def get(self, target: str) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "GET"),
            (":path", target),
            (":scheme", "http"),
            (":authority", self.authority),
        ]
        self.conn.send_headers(stream_id, headers, end_stream=True)
        self.flush()
        return stream_id

    def reset_stream(self, stream_id: int) -> float:
        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        data = self.conn.data_to_send()
        reset_at = time.monotonic()
        self.sock.sendall(data)
        return reset_at

    def read_until_ended(self, stream_id: int) -> None:
        self.read_until(lambda: stream_id in self.ended)

    def read_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    assert event.stream_id is not None
                    self.status[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    assert event.stream_id is not None
                    assert event.data is not None
                    self.body[event.stream_id] = self.body.get(event.stream_id, b"") + event.data
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length or 0, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    assert event.stream_id is not None
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    assert event.stream_id is not None
                    self.reset.add(event.stream_id)
            self.flush()


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
        assert_cancelled(
            server,
            doomed,
            closed_at=reset_at,
            response_started=endpoint == "stream",
            latencies=latencies,
            scenario=f"h2-{endpoint}",
            close="rst-stream",
        )
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
    for rid, response_started, scenario in [(slow, False, "slow"), (stream, True, "stream")]:
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=response_started,
            latencies=latencies,
            scenario=f"h2-{scenario}",
            close="conn-fin",
        )


def test_h2_connection_close_during_the_final_send(server: Server, latencies: Latencies) -> None:
    """The client grants no flow-control window, so the final body waits in the server's
    buffer; then it closes the connection. hypercorn never returns that send (its sender task
    stops with the connection, the buffer is never drained): without the middleware the app
    task waits in it forever (the soak found ~30 such tasks per 200 h2c requests). The
    middleware sees the send still in flight `grace` after the disconnect and cancels the app:
    the response never reached the client."""
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
        server,
        rid,
        closed_at=closed_at,
        response_started=True,
        latencies=latencies,
        scenario="h2-final-send",
        close="conn-fin",
    )
