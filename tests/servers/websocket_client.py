"""A raw-socket websocket client (RFC 6455) that leaves the ways real clients do: a close
frame, a TCP reset, or a socket closed during the handshake. Standard library only: the
real-vLLM tests use it from vLLM's own venv."""

from __future__ import annotations

import base64
import os
import socket
import struct
import time

from .client import RST, SOCKET_TIMEOUT, close, connect

TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


class WebSocketClosed(Exception):
    """The server closed the connection (a close frame or end of file)."""


def upgrade(port: int, path: str, *, headers: tuple[tuple[str, str], ...] = ()) -> socket.socket:
    """A connection with the upgrade request sent, its answer not read yet."""
    sock = connect(port)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket"]
    lines += ["Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    lines += [f"{name}: {value}" for name, value in headers]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    return sock


class WebSocket:
    """An accepted websocket connection: text messages in and out, and the ways to leave."""

    def __init__(self, sock: socket.socket, *, timeout: float = SOCKET_TIMEOUT) -> None:
        self.sock = sock
        self.timeout = timeout
        self.buffer = b""
        head = self._read_until(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"101":
            raise AssertionError(f"handshake refused: {head!r}")

    @classmethod
    def connect(
        cls, port: int, path: str, *, headers: tuple[tuple[str, str], ...] = ()
    ) -> WebSocket:
        return cls(upgrade(port, path, headers=headers))

    def send_text(self, text: str) -> None:
        self._send_frame(TEXT, text.encode())

    def receive_text(self) -> str:
        """The next text message (pings answered on the way)."""
        while True:
            opcode, payload = self._read_frame()
            if opcode == TEXT:
                return payload.decode()
            if opcode == PING:
                self._send_frame(PONG, payload)
            elif opcode == CLOSE:
                raise WebSocketClosed(payload)

    def send_close(self, code: int = 1000) -> float:
        """Send a close frame; return `time.monotonic()` taken right before it was written."""
        frame = self._frame(CLOSE, struct.pack("!H", code))
        closed_at = time.monotonic()
        self.sock.sendall(frame)
        return closed_at

    def finish_close(self) -> None:
        """After `send_close`: read what the server still sends, up to its close, then close."""
        try:
            while True:
                self._read_frame()
        except (WebSocketClosed, OSError):
            pass
        self.sock.close()

    def reset(self) -> float:
        """Drop the connection with a TCP reset, no close frame; return when."""
        return close(self.sock, RST)

    # -- frames ----------------------------------------------------------------------------------
    def _frame(self, opcode: int, payload: bytes) -> bytes:
        length = len(payload)
        if length < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        elif length < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
        mask = os.urandom(4)  # a client masks every frame (RFC 6455 5.3)
        repeated = (mask * (length // 4 + 1))[:length]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
            length, "big"
        )
        return head + mask + masked

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        self.sock.sendall(self._frame(opcode, payload))

    def _read_frame(self) -> tuple[int, bytes]:
        first, second = self._read_exactly(2)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self._read_exactly(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self._read_exactly(8))
        if second & 0x80:
            raise AssertionError("a server must not mask its frames")
        if not first & 0x80:
            raise AssertionError("fragmented messages are not expected here")
        return first & 0x0F, self._read_exactly(length)

    def _read_exactly(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self._receive_more()
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self._receive_more()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _receive_more(self) -> None:
        self.sock.settimeout(self.timeout)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise WebSocketClosed(b"")
        self.buffer += chunk
