"""What the real-server tests do and check again and again: leave a request, read its events."""

from __future__ import annotations

import statistics
import time

from .client import (
    CHUNK_MARKER,
    FIN,
    HALF,
    close,
    connect,
    get,
    read_head,
    read_to_eof,
    recv_some,
    send_request,
)
from .events import Event
from .latency import Latencies
from .runner import Server

# Watchdogs, not bounds: a disconnect is expected in milliseconds, the limits only stop a hang.
WATCHDOG = 5.0
CANCELLED_EXCEPTIONS = ("CancelledError", "Cancelled")
SETTLE = 10.0  # for what is still running after a test to end
PROBE_MEDIAN = 0.1  # a probe on another connection is answered at once
LOG_ALARMS = ("Traceback", "ERROR", "Exception in")


def leave(
    server: Server,
    target: str,
    rid: str,
    *,
    close_kind: str = FIN,
    stream: bool = False,
    via: Server | None = None,
) -> tuple[float, bytes]:
    """Request `target` (from `via`, a gateway in front, if given), then close the connection
    once `server`'s app works on request `rid` (a stream: once three chunks arrived). Returns
    the time of the close and, after a half-close, what the client still read until EOF."""
    with connect((via or server).port) as sock:
        send_request(sock, "GET", target)
        if stream:
            status, _, body = read_head(sock)
            assert status == 200
            while body.count(CHUNK_MARKER) < 3:
                body += recv_some(sock)
        else:
            server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, close_kind)
        return closed_at, read_to_eof(sock) if close_kind == HALF else b""


def assert_cancelled(
    server: Server,
    rid: str,
    closed_at: float,
    latencies: Latencies,
    scenario: str,
    *,
    close: str = FIN,
    response_started: bool = False,
) -> Event:
    """The client left at `closed_at`; then the token fired once (the hook ran), then the app
    saw the cancellation, then the middleware returned normally. The latency is kept for the
    summary, under `scenario` and `close`."""
    cancelled = server.events.wait_for(rid, "cancelled", timeout=WATCHDOG)
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    hooks = server.events.of(rid, "hook")
    assert cancelled["exc"] in CANCELLED_EXCEPTIONS
    assert cancelled["token_cancelled"] is True
    assert cancelled["reason"] == "client disconnected"
    assert exit_event["outcome"] == "returned"  # the middleware absorbed its own cancellation
    assert len(hooks) == 1, hooks
    assert hooks[0]["response_started"] is response_started
    assert hooks[0]["reason"] == "client disconnected"
    assert not server.events.of(rid, "done")
    assert closed_at < hooks[0]["t"] <= cancelled["t"] <= exit_event["t"]
    stopped, fired = cancelled["t"], hooks[0]["t"]
    latencies.add(server.spec.name, scenario, close, closed_at, stopped=stopped, fired=fired)
    server.assert_no_traceback()
    return cancelled


def assert_not_cancelled(server: Server, rid: str, *, finished: str) -> Event:
    """The request ran to its end: `finished` was recorded, and nothing was cancelled."""
    finished_event = server.events.wait_for(rid, finished, timeout=WATCHDOG)
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    assert exit_event["outcome"] == "returned"
    assert not server.events.of(rid, "cancelled")
    assert not server.events.of(rid, "hook")
    server.assert_no_traceback()
    return finished_event


def of(events: list[Event], name: str) -> list[Event]:
    return [event for event in events if event["event"] == name]


def one(events: list[Event], name: str) -> Event:
    found = of(events, name)
    assert len(found) == 1, f"expected one {name!r} event, got {found}; all: {events}"
    return found[0]


def assert_settled(server: Server, running: str = "/inflight") -> None:
    """Nothing is left running (`running` answers how many requests or sessions are), and a
    probe on another connection is answered at once (the median of three)."""
    deadline = time.monotonic() + SETTLE
    while get(server.port, running).body != b"0":
        assert time.monotonic() < deadline, f"{running}: still running after {SETTLE} s"
        time.sleep(0.05)
    probes = []
    for _ in range(3):
        started = time.monotonic()
        assert get(server.port, "/hello").body == b"hello"
        probes.append(time.monotonic() - started)
    assert statistics.median(probes) < PROBE_MEDIAN, probes


def assert_quiet(server: Server, log: str) -> None:
    """`log` (what the server wrote during a test) has no error and no traceback."""
    for word in LOG_ALARMS:
        assert word not in log, f"{server.spec} logged {word!r}:\n{log[-3000:]}"
