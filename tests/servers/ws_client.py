"""A raw-socket websocket client (RFC 6455) that leaves the ways real clients do: a close frame
with a code (and a reason), a TCP reset, or a FIN without a close frame; before the handshake
is answered, or halfway through sending it. Standard library only: the real-vLLM tests
(tests/vllm/test_realtime.py) use it from vLLM's own venv."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from .client import HALF, HOST, RST, close, connect, read_head

TEXT, BINARY, CLOSE, PING, PONG = 1, 2, 8, 9, 10
READ_TIMEOUT = 5.0  # a frame or the server's close is expected in milliseconds

CLOSE_1000 = "close1000"  # a close frame 1000, then read on until the server closes (polite)
CLOSE_4001 = "close4001"  # the same with an application's code and a reason
# client.RST, or client.HALF: shutdown(SHUT_WR), a FIN without a close frame (then read on until
# the server closes).
LEAVE_KINDS = (CLOSE_1000, CLOSE_4001, RST, HALF)
DROPS = (RST, HALF)  # the only ways to leave before the handshake is answered
CLOSE_FRAMES = {CLOSE_1000: (1000, ""), CLOSE_4001: (4001, "custom bye")}


@dataclass(frozen=True)
class Frame:
    opcode: int
    payload: bytes

    @property
    def close_code(self) -> int | None:
        """A close frame's code (None: none given)."""
        return struct.unpack("!H", self.payload[:2])[0] if len(self.payload) >= 2 else None


def frame(opcode: int, payload: bytes, *, zero_mask: bool = False) -> bytes:
    """One final, masked client frame. `zero_mask`: a mask of zeros, so that a frame of
    megabytes needs no XOR (servers accept any key)."""
    length = len(payload)
    if length < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
    if zero_mask:
        return head + bytes(4) + payload
    key = os.urandom(4)
    stream = (key * (length // 4 + 1))[:length]
    masked = int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")
    return head + key + masked.to_bytes(length, "big")


Headers = tuple[tuple[str, str], ...]


class WebSocket:
    """One connection whose handshake was answered with 101; frames read one at a time."""

    def __init__(self, sock: socket.socket, rest: bytes, timeout: float) -> None:
        self.sock = sock
        self.rest = rest  # read from the socket, not parsed yet
        self.timeout = timeout  # for each frame
        self.closed_ours = False  # a close frame or a FIN sent: nothing more goes out
        self.sender: threading.Thread | None = None
        self.send_error: BaseException | None = None

    @classmethod
    def connect(
        cls, port: int, target: str, *, headers: Headers = (), timeout: float = READ_TIMEOUT
    ) -> WebSocket:
        sock = start_handshake(port, target, headers=headers)
        try:
            status, _, rest = read_head(sock)
            assert status == 101, f"{target}: HTTP {status}, not 101"
        except BaseException:
            sock.close()
            raise
        return cls(sock, rest, timeout)

    def __enter__(self) -> WebSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.join(READ_TIMEOUT)
        self.sock.close()

    # -- sending ------------------------------------------------------------------------------
    def send_text(self, text: str) -> None:
        self.sock.sendall(frame(TEXT, text.encode()))

    def send_in_background(self, data: bytes) -> None:
        """`sendall(data)` in a thread: the server's backpressure may hold it for a while."""

        def send() -> None:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                self.send_error = exc

        self.sender = threading.Thread(target=send, daemon=True)
        self.sender.start()

    def wait_sent(self, timeout: float) -> None:
        assert self.sender is not None
        self.sender.join(timeout)
        assert not self.sender.is_alive(), f"still sending after {timeout} s"
        assert self.send_error is None, self.send_error

    # -- reading ------------------------------------------------------------------------------
    def read_frame(self) -> Frame | None:
        """The next frame, or None at EOF (or a reset); raises TimeoutError past `timeout`."""
        deadline = time.monotonic() + self.timeout
        while True:
            parsed = parse(self.rest)
            if parsed is not None:
                found, used = parsed
                self.rest = self.rest[used:]
                return found
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.rest += data

    def read_text(self) -> str:
        """The next text message, past binary frames and pings (answered); a close or EOF is
        an error."""
        while True:
            found = self.read_frame()
            assert found is not None, "the server closed the connection"
            assert found.opcode != CLOSE, f"the server closed with {found.close_code}"
            if found.opcode == TEXT:
                return found.payload.decode()
            if found.opcode == PING and not self.closed_ours:
                self.sock.sendall(frame(PONG, found.payload))

    def read_until_closed(self) -> Frame | None:
        """Read on until the closing handshake is over (the server's close frame after ours),
        or the server closes TCP (or resets, or is silent for READ_TIMEOUT): the server's close
        frame, if it sent one. A close the server started is answered with its code, as RFC
        6455 asks (uvicorn's `--ws websockets` waits 10 s for the answer)."""
        try:
            while (found := self.read_frame()) is not None:
                if found.opcode != CLOSE:
                    continue
                if not self.closed_ours:
                    self.closed_ours = True
                    self.sock.sendall(frame(CLOSE, found.payload[:2]))
                    with contextlib.suppress(TimeoutError, OSError):
                        self.read_frame()  # until the server closes TCP
                return found
        except (TimeoutError, OSError):
            pass
        return None

    # -- leaving ------------------------------------------------------------------------------
    def leave(self, kind: str) -> float:
        """Leave `kind`'s way; the time right before the frame or the system call. A close
        frame or a half-close is polite: the client reads on until the server closes its side (then
        closes its own), as browsers and the `websockets` library do."""
        self.closed_ours = True
        if kind in CLOSE_FRAMES:
            code, reason = CLOSE_FRAMES[kind]
            closing = frame(CLOSE, struct.pack("!H", code) + reason.encode())
            closed_at = time.monotonic()
            self.sock.sendall(closing)
        else:
            closed_at = close(self.sock, kind)
        return closed_at

    def leave_politely(self, kind: str) -> tuple[float, Frame | None]:
        """`leave(kind)`, then read until the server closes; its close frame, if any."""
        closed_at = self.leave(kind)
        return closed_at, None if kind == RST else self.read_until_closed()


def parse(data: bytes) -> tuple[Frame, int] | None:
    """The first whole (unmasked, server) frame in `data` and the bytes it used, or None."""
    if len(data) < 2:
        return None
    length, used = data[1] & 0x7F, 2
    if length >= 126:  # the length follows: 16 bits (126) or 64 (127)
        used += 2 if length == 126 else 8
        length = int.from_bytes(data[2:used], "big")  # if cut short, None follows
    if len(data) < used + length:
        return None
    return Frame(data[0] & 0x0F, data[used : used + length]), used + length


def start_handshake(
    port: int, target: str, *, partial: bool = False, headers: Headers = ()
) -> socket.socket:
    """A connection that sent the upgrade request for `target` (`partial`: only its first
    lines, then stalls) and has read nothing."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {HOST}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *(f"{name}: {value}" for name, value in headers),
    ]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    sock = connect(port)
    sock.sendall(request[: request.index(b"Upgrade:")] if partial else request)
    return sock
