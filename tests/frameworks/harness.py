"""Test-side helpers for the framework matrix: servers, requests, disconnects, assertions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from ..servers.checks import WATCHDOG
from ..servers.client import (
    CHUNK_MARKER,
    FIN,
    close,
    connect,
    new_id,
    read_head,
    read_to_eof,
    read_until_count,
    send_request,
)
from ..servers.events import Event
from ..servers.runner import Server, ServerSpec, running_server
from .latency import FrameworkLatencies

# "Promptly": the middleware cancels within one loop iteration, or `grace` (0.1 s) after the
# disconnect where the framework listens itself. A bound with room for a busy CI machine.
PROMPT = 0.5
# How long the slow endpoints of the disconnect cases work when nobody stops them: the control
# runs to the end within the test, and a cancelled request is far from its end.
WORK = 1.0
# Headers that differ between two responses for reasons other than the middleware.
VOLATILE_HEADERS = frozenset({"date", "server", "connection", "keep-alive"})


@contextmanager
def serve(
    spec: ServerSpec, target: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server for a test module; its log must end without a traceback or a 500."""
    workdir = tmp_path_factory.mktemp(target.split(".")[-1].replace(":", "-"))
    with running_server(spec, target, workdir) as server:
        yield server
        assert_clean_log(server)


@dataclass(frozen=True)
class FullResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def fetch(port: int, target: str) -> FullResponse:
    """One request on a new connection (`Connection: close`), read to EOF; chunked is decoded."""
    with connect(port) as sock:
        send_request(sock, "GET", target, headers=(("Connection", "close"),))
        status, headers, rest = read_head(sock)
        rest += read_to_eof(sock)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        rest = dechunk(rest)
    elif "content-length" in headers:
        rest = rest[: int(headers["content-length"])]
    return FullResponse(status, headers, rest)


def dechunk(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body
        body += data[:size]
        data = data[size + 2 :]


def stable_headers(response: FullResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k not in VOLATILE_HEADERS}


@dataclass
class Disconnect:
    """A request whose client closed the connection (FIN) while the app was working."""

    server: Server
    rid: str
    closed_at: float
    events: list[Event] = field(default_factory=list)

    def of(self, event: str) -> list[Event]:
        return [item for item in self.events if item["event"] == event]

    def one(self, event: str) -> Event:
        found = self.of(event)
        assert len(found) == 1, f"expected one {event!r} event, got {found}; all: {self.events}"
        return found[0]

    def since_close(self, event: str) -> float:
        return float(self.one(event)["t"]) - self.closed_at

    def refresh(self) -> None:
        self.events = self.server.events.of(self.rid)


def disconnect(
    server: Server,
    path: str,
    *,
    query: str = "",
    stream: bool = False,
    settle: float = 0.0,
    until: tuple[str, ...] = ("exit",),
    timeout: float = WORK + WATCHDOG,
) -> Disconnect:
    """Start `path`, close the connection (FIN) once the app works, wait for `until` events.

    For a stream, the client reads three chunks first. `settle` waits after the last `until`
    event, for events that would come late if they came at all (a second cleanup, a use after
    close).
    """
    rid = new_id()
    target = f"{path}?id={rid}&t={WORK}" + (f"&{query}" if query else "")
    with connect(server.port) as sock:
        send_request(sock, "GET", target)
        if stream:
            status, _, body = read_head(sock)
            assert status == 200
            read_until_count(sock, CHUNK_MARKER, 3, body)
        else:
            server.events.wait_for(rid, "start", timeout=WATCHDOG)
            time.sleep(0.05)  # the app is well inside its work
        closed_at = close(sock, FIN)
    for event in until:
        server.events.wait_for(rid, event, timeout=timeout)
    if settle:
        time.sleep(settle)
    result = Disconnect(server, rid, closed_at)
    result.refresh()
    return result


def assert_clean_log(server: Server) -> None:
    server.assert_no_traceback()
    log = server.log()
    assert " 500" not in log, f"{server.spec} logged a 500:\n{log[-4000:]}"


def assert_next_request_served(
    server: Server, path: str = "/hello", body: bytes = b"hello"
) -> None:
    response = fetch(server.port, path)
    assert (response.status, response.body) == (200, body)


def assert_cancelled_promptly(
    case: Disconnect,
    latencies: FrameworkLatencies,
    framework: str,
    scenario: str,
    *,
    by: str = "cancelled",
) -> None:
    """(1) the app stopped (`by`: its CancelledError, or a thread's `stopped`) promptly after
    the FIN, the token fired once, and the work never reached its end; the latency is kept."""
    stopped = case.one(by)
    hooks = case.of("hook")
    assert len(hooks) == 1, hooks
    assert hooks[0]["reason"] == "client disconnected"
    assert stopped["token_cancelled"] is True, stopped
    latency = case.since_close(by)
    fired = case.since_close("hook")
    assert 0 < fired < PROMPT, case.events
    assert 0 < latency < PROMPT, case.events
    assert not case.of("done"), case.events
    latencies.add(framework, scenario, case.server.spec.name, cancel_s=latency, fired_s=fired)


def assert_cleanup_once(case: Disconnect, *events: str) -> None:
    """(2) every cleanup ran exactly once; (3) nothing was used after its teardown."""
    for event in events:
        assert len(case.of(event)) == 1, (event, case.events)
    assert not case.of("used_after_close"), case.events
    for teardown in case.of("teardown"):
        assert teardown["already_closed"] is False, case.events


def assert_after(case: Disconnect, later: str, earlier: str) -> None:
    """`later` happened after `earlier` (e.g. a teardown only once the thread returned)."""
    assert case.one(later)["t"] >= case.one(earlier)["t"], case.events


def assert_ran_to_end(case: Disconnect) -> None:
    """Control: nothing cancelled the work; it ran its whole `WORK` seconds after the FIN."""
    case.one("done")
    assert not case.of("cancelled"), case.events
    assert not case.of("stopped"), case.events
    assert not case.of("hook"), case.events


def assert_self_cancelled(case: Disconnect, *, by: str = "cancelled") -> None:
    """Control: the framework stopped its own handler on the disconnect, promptly (`by`: a
    `CancelledError`, or `closed_by_framework` for a generator it closed)."""
    cancelled = case.one(by)
    assert cancelled["token_cancelled"] is False  # no middleware, no token
    assert 0 < cancelled["t"] - case.closed_at < PROMPT, case.events
    assert not case.of("done"), case.events
    assert not case.of("hook"), case.events
