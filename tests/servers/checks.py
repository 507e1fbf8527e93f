"""Assertions shared by the real-server tests."""

from __future__ import annotations

from .events import Event
from .latency import Latencies
from .runner import Server

# Watchdogs, not bounds: a disconnect is expected in milliseconds, the limits only stop a hang.
WATCHDOG = 5.0
CANCELLED_EXCEPTIONS = ("CancelledError", "Cancelled")


def assert_cancelled(
    server: Server,
    rid: str,
    *,
    closed_at: float,
    response_started: bool,
    latencies: Latencies,
    scenario: str,
    close: str,
    exceptions: tuple[str, ...] = CANCELLED_EXCEPTIONS,
) -> Event:
    """The app saw a cancellation after `closed_at`, the token fired once, the server got None.

    `exceptions` names what the app's "cancelled" event may report: the cancellation exception,
    or "none" for code that stopped by polling `token.cancelled`.
    """
    cancelled = server.events.wait_for(rid, "cancelled", timeout=WATCHDOG)
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    hooks = server.events.of(rid, "hook")
    assert cancelled["exc"] in exceptions
    assert cancelled["token_cancelled"] is True
    assert cancelled["reason"] == "client disconnected"
    assert exit_event["outcome"] == "returned"  # the middleware absorbed its own cancellation
    assert len(hooks) == 1, hooks
    assert hooks[0]["response_started"] is response_started
    assert hooks[0]["reason"] == "client disconnected"
    assert not server.events.of(rid, "done")
    latency = cancelled["t"] - closed_at
    assert 0 < latency < WATCHDOG
    latencies.add(
        server.spec.name,
        scenario,
        close,
        cancel_s=latency,
        fired_s=hooks[0]["t"] - closed_at,
    )
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
