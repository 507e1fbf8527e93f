"""A raw-socket HTTP/1.1 client that closes connections the three ways real clients do."""

from __future__ import annotations

import socket
import struct
import time
import uuid
from dataclasses import dataclass

HOST = "127.0.0.1"
SOCKET_TIMEOUT = 10.0

CHUNK_MARKER = b"chunk\n"

FIN = "fin"  # close(): the kernel sends FIN
RST = "rst"  # SO_LINGER (1, 0), then close(): the kernel sends RST
HALF = "half"  # shutdown(SHUT_WR): FIN, but the socket stays open for reading
CLOSE_KINDS = (FIN, RST, HALF)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def connect(port: int, *, timeout: float = SOCKET_TIMEOUT) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_request(
    sock: socket.socket,
    method: str,
    target: str,
    *,
    headers: tuple[tuple[str, str], ...] = (),
    body: bytes = b"",
) -> None:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {HOST}"]
    lines += [f"{name}: {value}" for name, value in headers]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


def close(sock: socket.socket, kind: str) -> float:
    """Close the connection; return `time.monotonic()` taken right before the system call."""
    if kind == FIN:
        # close() with unread bytes in the receive buffer sends RST, not FIN (RFC 2525 2.17):
        # read what has arrived first, as a client that stops reading a stream would.
        drain(sock)
        closed_at = time.monotonic()
        sock.close()
    elif kind == RST:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        closed_at = time.monotonic()
        sock.close()
    elif kind == HALF:
        closed_at = time.monotonic()
        sock.shutdown(socket.SHUT_WR)
    else:
        raise ValueError(f"unknown close kind {kind!r}")
    return closed_at


def drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(SOCKET_TIMEOUT)


def recv_some(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("server closed the connection")
    return data


def read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read the status line and headers; return them and whatever body bytes came along."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += recv_some(sock)
    head, rest = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, rest


def read_status(sock: socket.socket) -> int | None:
    """The status of the answer, or None if the server closed (or said nothing) without one."""
    try:
        return read_head(sock)[0]
    except (ConnectionError, TimeoutError):
        return None


def read_response(sock: socket.socket) -> Response:
    """Read one response with a Content-Length body (all the probe apps send one)."""
    status, headers, body = read_head(sock)
    length = int(headers["content-length"])
    while len(body) < length:
        body += recv_some(sock)
    return Response(status, headers, body[:length])


def get(port: int, target: str, *, timeout: float = SOCKET_TIMEOUT) -> Response:
    with connect(port, timeout=timeout) as sock:
        send_request(sock, "GET", target)
        return read_response(sock)


def fetch(port: int, method: str, target: str, body: bytes = b"") -> Response:
    """One request on a new connection (`Connection: close`), read to EOF; chunked is decoded."""
    headers = [("Connection", "close")]
    if body or method == "POST":
        headers.append(("Content-Length", str(len(body))))
    with connect(port) as sock:
        send_request(sock, method, target, headers=tuple(headers), body=body)
        status, response_headers, rest = read_head(sock)
        rest += read_to_eof(sock)
    if response_headers.get("transfer-encoding", "").lower() == "chunked":
        rest = dechunk(rest)
    elif "content-length" in response_headers:
        rest = rest[: int(response_headers["content-length"])]
    return Response(status, response_headers, rest)


def dechunk(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body
        body += data[:size]
        data = data[size + 2 :]
