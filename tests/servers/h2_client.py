"""An h2c client (prior knowledge, the `h2` library) for the h2 tests and the soak."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

from .client import HOST, recv_some


class H2Client:
    """Just enough of one: requests, resets, and reading one stream to its end."""

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
            for event in self.conn.receive_data(recv_some(self.sock)):
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
            self.flush()
