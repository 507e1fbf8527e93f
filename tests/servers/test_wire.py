"""What goes over the wire with the middleware, against what goes without it, on every server.

Hostile and unusual clients, on each HTTP/1.1 server of the table (docs/servers.md), one
process per server serving the same endpoints bare and wrapped (`servers.apps:wire`):

- a 100 KB value for each header the middleware parses, and request ids of every kind;
- pipelined requests (answered in order, and a close during the first logs nothing);
- `Expect: 100-continue` to an app that refuses without reading: `100 Continue` is sent, or
  not, exactly as without the middleware;
- a deadline that cuts a started stream: the client can tell it was cut;
- an outer middleware whose send never returns once the client left.

Throughout: the server logs no ERROR and no traceback, no request is left running, and a probe
on another connection is answered at once (median of three under 100 ms).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest

from .checks import assert_quiet, assert_settled
from .client import CHUNK_MARKER, connect, read_head, read_status, recv_some, send_request
from .runner import HTTP1_SERVERS, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

PREFIXES = ("bare", "wrapped")
# Errors of a server's own, seen on the bare route too, that the log check forgives (the whole
# traceback, and the line that announces it, must end in the signature).
SERVER_BUGS = {
    # hypercorn's trio worker sends `100 Continue` from its reading task while the app's
    # response is being sent from another: trio refuses two tasks sending on one stream.
    "hypercorn-trio": "trio.BusyResourceError: another task is currently sending data",
}


@pytest.fixture(scope="module", params=HTTP1_SERVERS, ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp(request.param.name)
    with running_server(request.param, "tests.servers.apps:wire", workdir) as running:
        yield running


@pytest.fixture(autouse=True)
def quiet_and_settled(server: Server) -> Iterator[None]:
    """After each test: nothing left running, the server answers at once, its log is clean."""
    logged = len(server.log())
    yield
    assert_settled(server)
    assert_quiet(server, without_server_bugs(server, server.log()[logged:]))


def without_server_bugs(server: Server, log: str) -> str:
    signature = SERVER_BUGS.get(server.spec.name)
    if signature is None:
        return log
    traceback = re.compile(
        r"^.*\[ERROR\].*\n"  # hypercorn's "[ERROR] Error in ASGI Framework"
        r"Traceback \(most recent call last\):\n"
        r"(?:[ \t].*\n)*"  # the frames, all indented: no chained exception
        + re.escape(signature)
        + r".*\n?",
        re.MULTILINE,
    )
    return traceback.sub("", log)


def responses(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` responses with a Content-Length body, in order, from one connection."""
    found: list[tuple[int, bytes]] = []
    rest = b""
    while len(found) < count:
        while b"\r\n\r\n" not in rest:
            rest += recv_some(sock)
        head, rest = rest.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")[1:]
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            rest += recv_some(sock)
        found.append((status, rest[:length]))
        rest = rest[length:]
    return found


def read_to_close(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


# -- hostile headers ----------------------------------------------------------------------------
@pytest.mark.parametrize("header", ["X-Request-Id", "X-Request-Timeout"])
def test_a_100_kb_header_is_answered_at_once(server: Server, header: str) -> None:
    """400 from the middleware, or the server's own limit (431, 400, 413, a close): never a
    stall of the loop (the budget pattern took 22.9 s at 100 KB)."""
    with connect(server.port) as sock:
        value = "1" + " " * 100_000 + "x"
        send_request(sock, "GET", "/wrapped/slow?t=0", headers=((header, value),))
        reply = read_status(sock)
    assert reply in (400, 413, 431, None)  # None: the server refused it itself and closed


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", 200),
        (b"x" * 200, 200),
        (b"x" * 201, 400),
        (b"caf\xe9", 400),
        (b"a/b", 400),
        (b"a b", 400),
        (b"<script>", 400),
    ],
    ids=["uuid", "200-characters", "201-characters", "latin-1", "slash", "space", "markup"],
)
def test_request_ids_of_every_kind(server: Server, raw: bytes, status: int) -> None:
    with connect(server.port) as sock:
        request = b"GET /wrapped/id HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + raw + b"\r\n\r\n"
        sock.sendall(request)
        ((got, body),) = responses(sock, 1)
    assert got == status
    if status == 200:
        assert body == raw


# -- pipelining ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", PREFIXES)
def test_pipelined_requests_are_answered_in_order(server: Server, prefix: str) -> None:
    with connect(server.port) as sock:
        for index in range(3):
            send_request(sock, "GET", f"/{prefix}/slow?t=0.0{index}")
        assert responses(sock, 3) == [(200, b"slow done")] * 3


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_close_during_pipelined_requests_logs_nothing(server: Server, prefix: str) -> None:
    """uvicorn (httptools) logged 'RuntimeError: ... TCPTransport closed' under the
    middleware: the watcher's receive() undid uvicorn's pause for pipelined requests."""
    with connect(server.port) as sock:
        for _ in range(3):
            send_request(sock, "GET", f"/{prefix}/slow?t=0.5")
        time.sleep(0.3)
    # quiet_and_settled: the requests end (run out, or cancelled where the server tells), the
    # log is clean.


# -- Expect: 100-continue -----------------------------------------------------------------------
def expectation_answer(server: Server, prefix: str) -> tuple[bool, int | None]:
    """Whether `100 Continue` came before the final response (the client would then upload
    its body), and the final status (None: none within a second, the server waits for the
    body). The client never sends the body."""
    with connect(server.port, timeout=1.5) as sock:
        headers = (("Expect", "100-continue"), ("Content-Length", "100000000"))
        send_request(sock, "POST", f"/{prefix}/refuse", headers=headers)
        data = b""
        try:
            while b"HTTP/1.1 4" not in data:
                data += recv_some(sock)
        except (ConnectionError, TimeoutError):
            pass
    continued = data.startswith(b"HTTP/1.1 100")
    final = data.find(b"HTTP/1.1 4")
    return continued, None if final < 0 else int(data[final + 9 : final + 12])


def test_expect_100_continue_is_answered_as_without_the_middleware(server: Server) -> None:
    bare = expectation_answer(server, "bare")
    assert expectation_answer(server, "wrapped") == bare


# -- a cut stream -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chunked", "length", "sse"])
def test_a_stream_cut_by_its_deadline_looks_cut(server: Server, kind: str) -> None:
    with connect(server.port) as sock:
        deadline = (("X-Request-Timeout", "300ms"),)
        send_request(sock, "GET", f"/wrapped/stream?kind={kind}", headers=deadline)
        status, headers, body = read_head(sock)
        body += read_to_close(sock)
    assert status == 200
    if kind == "length":
        assert 0 < len(body) < int(headers["content-length"])  # short: httpx, curl can tell
    elif kind == "chunked":
        assert body.count(CHUNK_MARKER) >= 3
        assert not body.endswith(b"0\r\n\r\n")  # no final chunk: the client can tell
    else:
        assert b"event: error\r\n" in body or b"event: error\n" in body
        assert b"deadline exceeded" in body


# -- a send that never returns ------------------------------------------------------------------
def test_a_send_that_never_returns_after_the_client_left_keeps_nothing(server: Server) -> None:
    """The middleware's 499 completion goes to an outer middleware that blocks forever: the
    request still ends (quiet_and_settled waits for it)."""
    with connect(server.port) as sock:
        send_request(sock, "GET", "/hung/slow?t=30")
        time.sleep(0.2)
