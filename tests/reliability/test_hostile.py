"""Hostile clients against real servers with the middleware: slowloris, slow 5 MB uploads
against the `read_ahead` bound, resets mid-header and mid-body, ~1,000 idle connections.

Throughout: nothing hangs (every socket has a timeout), a normal request is served during and
after each attack, the server logs no traceback. The figures are printed (shown with -rA)
and quoted in docs/reliability.md."""

from __future__ import annotations

import hashlib
import resource
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

import pytest

from ..servers.client import HOST, RST, close, connect, get, read_response, send_request
from ..servers.events import BIG_READ_AHEAD
from ..servers.runner import Server, ServerSpec, serving
from .shutdown import HYPERCORN, UVICORN, WITH, WITHOUT
from .soak import settle, stats

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

BIG = "tests.servers.apps:big_app"
READ_AHEAD = 64 * 1024  # the middleware's default

SLOWLORIS = 200  # connections per kind (headers, then body)
RESETS = 100  # per kind (mid-header, mid-body)
IDLE = 1000
UPLOADS = 40  # concurrent slow uploads
UPLOAD_SIZE = 5 * 1024 * 1024
UPLOAD_PIECE = 16 * 1024
UPLOADS_FINISHED = 3  # of them, sent to the end and checked; the others reset mid-body
SERVE_TIMEOUT = 10.0  # "a normal request is served": well within this, or the test fails


def assert_serving(server: Server) -> None:
    response = get(server.port, "/hello", timeout=SERVE_TIMEOUT)
    assert (response.status, response.body) == (200, b"hello")


@contextmanager
def no_task_left(server: Server, attack: str) -> Iterator[None]:
    """Around an attack: a normal request is served after it, the middleware's and the app's
    tasks are back to where they were (the server's own are not asserted: hypercorn keeps
    closed connections' tasks ~20 s, with or without us), and the log has no traceback."""
    before = stats(server.port)
    yield
    assert_serving(server)
    after = settle(server.port, before.ours)
    print(  # noqa: T201  (shown with -rA)
        f"{server.spec} {attack}: tasks {before.tasks} -> {after.tasks} after "
        f"(ours {before.ours} -> {after.ours})"
    )
    assert after.ours <= before.ours, after.stacks
    server.assert_no_traceback()


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@contextmanager
def attacked(spec: ServerSpec, target: str, tmp: pytest.TempPathFactory) -> Iterator[Server]:
    # The shutdown specs: a 1 s graceful timeout, so stopping a server with attackers' requests
    # still parked in it never waits on them.
    raise_fd_limit(2 * IDLE + 2 * SLOWLORIS + 256)  # the server inherits it
    with serving(spec, target, tmp) as server:
        assert_serving(server)
        yield server


@pytest.fixture(scope="module", params=[UVICORN, HYPERCORN], ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with attacked(request.param, WITH, tmp_path_factory) as server:
        yield server


def test_slowloris(server: Server) -> None:
    """Headers sent then silence; a partial body then silence; on many connections."""
    with no_task_left(server, f"slowloris x{2 * SLOWLORIS}"), ExitStack() as socks:
        for index in range(SLOWLORIS):
            sock = socks.enter_context(connect(server.port))
            sock.sendall(f"GET /hello?id=h{index} HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode())
        for index in range(SLOWLORIS):
            sock = socks.enter_context(connect(server.port))
            length = (("Content-Length", "1000"),)
            send_request(sock, "POST", f"/echo?id=b{index}", headers=length, body=b"x" * 100)
        assert_serving(server)
        time.sleep(1.0)  # silence
        assert_serving(server)
        print(f"{server.spec} slowloris: tasks {stats(server.port).tasks} during")  # noqa: T201


def test_resets_mid_header_and_mid_body(server: Server) -> None:
    with no_task_left(server, f"resets x{2 * RESETS}"):
        for index in range(RESETS):
            header = f"GET /slow?id=rh{index} HTTP/1.1\r\nHost: {HOST}\r\nX-Cut: ab"
            head = f"POST /echo?id=rb{index} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 50000"
            body = head.encode() + b"\r\n\r\n" + b"y" * (index * 97 % 20000)
            for data in (header.encode(), body):
                sock = connect(server.port)
                sock.sendall(data)
                close(sock, RST)
            if index % 25 == 0:
                assert_serving(server)


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # data on an idle connection: count it as open
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_idle_connections(server: Server) -> None:
    rss_before = stats(server.port).rss_kib
    with no_task_left(server, f"idle x{IDLE}"), ExitStack() as stack:
        socks = []
        for index in range(IDLE):
            socks.append(stack.enter_context(connect(server.port)))
            if index % 250 == 0:
                assert_serving(server)
        time.sleep(1.0)
        rss_during = stats(server.port).rss_kib
        held = sum(still_open(sock) for sock in socks)
        assert_serving(server)
    per_connection = (rss_during - rss_before) / IDLE
    print(  # noqa: T201
        f"{server.spec} idle: {held}/{IDLE} held open after 1 s; RSS {rss_before} -> "
        f"{rss_during} KiB ({per_connection:.1f} KiB per connection)"
    )
    if server.spec is UVICORN:
        # hypercorn closes most of them within the second, with or without us: the middleware
        # never sees a connection that sends nothing (reported in docs/reliability.md).
        assert held == IDLE


def slow_uploads(server: Server, target: str) -> float:
    """UPLOADS connections each send a 5 MB body, a piece at a time, to `/digest` (which does
    not read it until `/open`), until no socket takes more; RSS is read then. The gate is then
    opened: UPLOADS_FINISHED uploads are sent to the end and checked, the others reset.
    Returns the RSS (KiB) the server grew by, per upload."""
    body = bytes(range(256)) * (UPLOAD_SIZE // 256)
    rss_before = stats(server.port).rss_kib
    socks = []
    sent = [0] * UPLOADS
    with ExitStack() as stack:
        for index in range(UPLOADS):
            sock = stack.enter_context(connect(server.port))
            socks.append(sock)
            # A small send buffer: the bytes a stalled upload parks stay mostly in the
            # server's process or its socket, not in this client's kernel.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UPLOAD_PIECE)
            length = (("Content-Length", str(UPLOAD_SIZE)),)
            send_request(sock, "POST", f"/digest?id=u{index}", headers=length)
            sock.setblocking(False)
        stalled_since = time.monotonic()
        deadline = time.monotonic() + 20.0
        while time.monotonic() - stalled_since < 0.5 and time.monotonic() < deadline:
            for index, sock in enumerate(socks):
                with suppress(BlockingIOError):  # this one's buffers are full
                    count = sock.send(body[sent[index] : sent[index] + UPLOAD_PIECE])
                    sent[index] += count
                    if count:  # 0 once the whole body is sent
                        stalled_since = time.monotonic()
            time.sleep(0.005)  # slowly
        # Not a bound: loopback socket buffers are large (the server's grows to MBs).
        assert min(sent) > 0
        assert_serving(server)
        rss_during = stats(server.port).rss_kib
        get(server.port, "/open", timeout=SERVE_TIMEOUT)
        digest = f"{UPLOAD_SIZE} {hashlib.sha256(body).hexdigest()}".encode()
        for index, sock in enumerate(socks):
            if index < UPLOADS_FINISHED:
                sock.settimeout(SERVE_TIMEOUT)
                sock.sendall(body[sent[index] :])
                assert read_response(sock).body == digest
            else:
                close(sock, RST)
        assert_serving(server)
    per_upload = (rss_during - rss_before) / UPLOADS
    print(  # noqa: T201  (shown with -rA)
        f"uvicorn {target}: {UPLOADS} slow 5 MB uploads, RSS {rss_before} -> {rss_during} KiB, "
        f"{per_upload:.1f} KiB per upload; the client's kernel took "
        f"{sum(sent) / UPLOADS / 1024:.0f} KiB per upload"
    )
    return per_upload


def test_slow_uploads_memory_bounded_by_read_ahead(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    per_upload = {}
    for target in (WITHOUT, WITH, BIG):  # each on a fresh uvicorn: from a clean start
        with attacked(UVICORN, target, tmp_path_factory) as server:
            per_upload[target] = slow_uploads(server, target)
    control, ours, big = per_upload[WITHOUT], per_upload[WITH], per_upload[BIG]

    # What the middleware adds per request follows its read-ahead (measured: +67 KiB for
    # 64 KiB, +1,050-1,080 KiB for 1 MiB), never the body; the slack is for the allocator.
    def bound(read_ahead: int) -> float:
        return 1.25 * read_ahead / 1024 + 32

    assert ours - control <= bound(READ_AHEAD)
    assert big - control <= bound(BIG_READ_AHEAD)
    assert big < UPLOAD_SIZE / 1024 / 2
