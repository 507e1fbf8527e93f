"""Websocket sessions on every server that speaks websockets (`runner.WS_SERVERS`), one process
per server serving each route bare and wrapped (`servers.ws_apps:sockets`), and a raw client
that really goes away: a close frame (1000; 4001 with a reason), a TCP reset, a FIN without a
close frame (a half-close); before the handshake is answered, or halfway through sending it.

- An app busy sending (an LLM streaming tokens, never in receive()) is cancelled once with the
  middleware, 40 unread client messages or none; without it, hypercorn and granian let it send
  on for nobody, and uvicorn and daphne tell it by a failing send, if at all.
- A listener gets the disconnect (the server's code, replayed) and ends by itself.
- An app that waits before accepting is cancelled in its wait (granian says nothing before the
  accept: there the app learns it right after); without the middleware it waits for nobody.
- Numbered messages the app reads late, and a flood far past `read_ahead`, reach it all, in
  order, while the middleware holds at most `read_ahead` of them.
- An oversized frame meets the server's own limit, the same with the middleware as without;
  a half-sent handshake starts nothing and blocks nobody.

After each test: no session left running, a probe answered at once, no ERROR or traceback in
the server's log. Latencies go to latency.py's summary, messages and what each server did to
delivery.py's. Where a server's send fails before its receive() returns the disconnect
(uvicorn, daphne), the token fires at that send; a session cancelled before its accept is
answered with a close (without it uvicorn's `--ws websockets` logs an ERROR).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from asgi_cancel._session import MESSAGE_COST

from .checks import CANCELLED_EXCEPTIONS, WATCHDOG, assert_quiet, assert_settled, of, one
from .client import RST, close, new_id
from .delivery import Deliveries
from .events import WS_READ_AHEAD, Event
from .latency import Latencies
from .runner import WS_SERVERS, Server, ServerSpec, running_server
from .ws_client import (
    BINARY,
    CLOSE,
    CLOSE_1000,
    CLOSE_FRAMES,
    DROPS,
    LEAVE_KINDS,
    TEXT,
    WebSocket,
    frame,
    start_handshake,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

PREFIXES = ("wrapped", "bare")
CANCEL_BOUND = 0.5  # close -> the app cancelled; measured in milliseconds, bounded generously
UNREAD = 40  # past uvicorn-websockets' queue (32 messages) and hypercorn's (10)
CONTROL_RUN = 1.5  # how long the control's busy app sends
RAN_ON = 1.0  # ... of which at least this long after its client left
HANDSHAKE_WAIT = 0.5
# /late's numbered messages: how many, the bytes of each (0: unpadded), how long the app holds
# off reading them. The flood's 6 MB are past the kernel's buffers too.
MESSAGES = {"late": (100, 0, 0.3), "flood": (6000, 1024, 0.5)}
OVERSIZE = 16 * 1024 * 1024 + 1  # past uvicorn's --ws-max-size and hypercorn's default limit

# hypercorn hands the app 1006 for every close the client started, its code dropped.
CODE_LOST = {"hypercorn-asyncio", "hypercorn-trio"}
# Sends that return normally once the client has gone: an app that only sends never learns.
SILENT_SENDS = {"hypercorn-asyncio", "hypercorn-trio", "granian"}
# uvicorn's `--ws websockets` tells the app of a connection it failed (a frame past its limit)
# only after its close timeout.
CLOSE_TIMEOUTS = {"uvicorn-websockets": 10.0}
# granian delivers no disconnect before the accept; the first receive() after it gets one.
SILENT_BEFORE_ACCEPT = {"granian"}


@pytest.fixture(scope="module", params=WS_SERVERS, ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    spec: ServerSpec = request.param
    target = "tests.servers.ws_apps:sockets"
    with running_server(spec, target, tmp_path_factory.mktemp(spec.name)) as server:
        warm_up(server)
        yield server
        assert_quiet(server, server.log())


def warm_up(server: Server) -> None:
    """A process's first sessions pay for imports (anyio's backend, at the first `fail_after`:
    tens of ms with the event loop blocked): paid here, before anything is measured."""
    for prefix in PREFIXES:
        with WebSocket.connect(server.port, f"/{prefix}/busy?t=0.02") as ws:
            ws.read_until_closed()


@pytest.fixture(autouse=True)
def quiet_and_settled(server: Server) -> Iterator[None]:
    """After each test: no session left running, the server answers at once, its log is clean."""
    logged = len(server.log())
    yield
    assert_settled(server, "/sessions")
    assert_quiet(server, server.log()[logged:])


def close_codes(server: Server, leave: str) -> set[int]:
    """The codes the server may hand the app when its client leaves `leave`'s way."""
    if leave in CLOSE_FRAMES and server.spec.name not in CODE_LOST:
        return {CLOSE_FRAMES[leave][0]}
    return {1006} if server.spec.name in CODE_LOST else {1005, 1006}


def assert_session_cancelled(
    server: Server,
    rid: str,
    closed_at: float,
    leave: str,
    latencies: Latencies,
    scenario: str,
    *,
    accepted: bool = True,
) -> None:
    """The client left at `closed_at`: the token fired once (the hook, with the server's close
    code), then the app was cancelled, within CANCEL_BOUND, and the middleware returned."""
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    events = server.events.of(rid)
    hooks, told = of(events, "hook"), of(events, "send_failed")
    assert len(hooks) == 1, events
    hook = hooks[0]
    assert hook["reason"] == "client disconnected"
    assert hook["response_started"] is accepted
    if told:  # the server's failing send came first (no close code yet): the token fired then
        ended = one(events, "send_failed")
        assert hook["close_code"] in (None, *close_codes(server, leave)), hook
    else:
        assert hook["close_code"] in close_codes(server, leave), hook
        ended = one(events, "cancelled")
        assert ended["exc"] in CANCELLED_EXCEPTIONS
        assert exit_event["outcome"] == "returned"  # the middleware absorbed its cancellation
        assert not of(events, "done"), events
    assert ended["token_cancelled"] is True
    assert not of(events, "sent"), events  # it never ran to its end
    assert closed_at < hook["t"] <= ended["t"] <= exit_event["t"]
    assert ended["t"] - closed_at < CANCEL_BOUND
    latencies.add(server.spec.name, scenario, leave, closed_at, stopped=ended["t"], fired=hook["t"])


# -- an app busy sending --------------------------------------------------------------------------
def leave_busy(server: Server, target: str, rid: str, leave: str, unread: int) -> float:
    """Open a session of `target` (a `/busy`), send it `unread` messages, leave `leave`'s way."""
    with WebSocket.connect(server.port, target) as ws:
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        for number in range(unread):  # the app never reads them: the server's queue fills up
            ws.send_text(f"{number} unread")
        closed_at, _ = ws.leave_politely(leave)
    return closed_at


@pytest.mark.parametrize("unread", [0, UNREAD], ids=["none-unread", f"{UNREAD}-unread"])
@pytest.mark.parametrize("leave", LEAVE_KINDS)
def test_busy_session_cancelled_once_when_its_client_leaves(
    server: Server, leave: str, unread: int, latencies: Latencies
) -> None:
    rid = new_id()
    target = f"/wrapped/busy?id={rid}&t={WATCHDOG + 1}"
    closed_at = leave_busy(server, target, rid, leave, unread)
    scenario = "ws busy" + (f", {unread} unread" if unread else "")
    assert_session_cancelled(server, rid, closed_at, leave, latencies, scenario)


def test_busy_session_sends_on_for_nobody_without_the_middleware(
    server: Server, deliveries: Deliveries
) -> None:
    """Every way of leaving at once, each on its own connection: the app is never cancelled.
    On hypercorn and granian every send returns normally and the app sends on for the rest of
    its run (on hypercorn, after a reset with unread messages, a send hangs for good);
    uvicorn and daphne may tell it by a send that raises (uvicorn: not once the client's
    unread messages filled its queue: it stops reading and sees no close)."""
    cases = [(new_id(), leave, unread) for leave in LEAVE_KINDS for unread in (0, UNREAD)]
    with ThreadPoolExecutor(len(cases)) as pool:
        left = pool.map(
            lambda case: leave_busy(server, f"/bare/busy?id={case[0]}&t={CONTROL_RUN}", *case),
            cases,
        )
        closed = dict(zip((rid for rid, *_ in cases), left, strict=True))
    for rid, leave, unread in cases:
        server.events.wait_for(rid, "exit", timeout=CONTROL_RUN + WATCHDOG)
        events = server.events.of(rid)
        assert not of(events, "cancelled"), events
        assert not of(events, "hook"), events
        assert one(events, "start")["token_cancelled"] is None  # no middleware, no token
        after = f"busy control, {leave}, {unread} unread"
        if of(events, "sent"):
            ran_on = one(events, "sent")["t"] - closed[rid]
            assert ran_on >= RAN_ON, events
            deliveries.add_outcome(server.spec.name, after, "sent on for nobody")
            continue
        failed = one(events, "send_failed")
        if failed["exc"] == "hung":  # hypercorn, unread messages and a reset: stuck for good
            assert failed["t"] - closed[rid] >= RAN_ON, events
            deliveries.add_outcome(server.spec.name, after, "send hung (given up after 2 s)")
        else:
            assert server.spec.name not in SILENT_SENDS, events
            deliveries.add_outcome(server.spec.name, after, f"send raised {failed['exc']}")


# -- a listener -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("leave", LEAVE_KINDS)
def test_listening_session_ends_by_itself(
    server: Server, leave: str, prefix: str, latencies: Latencies
) -> None:
    """An app waiting in receive() gets the disconnect, with the server's code, and returns;
    with the middleware the token has fired too (once), and nothing was cancelled."""
    rid = new_id()
    with WebSocket.connect(server.port, f"/{prefix}/chat?id={rid}") as ws:
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        ws.send_text("hello")
        assert ws.read_text() == "hello"
        closed_at, _ = ws.leave_politely(leave)
    disconnect, done = assert_listener_ended(server, rid)
    events = server.events.of(rid)
    assert disconnect["code"] in close_codes(server, leave), disconnect
    hooks = of(events, "hook")
    if prefix == "bare":
        assert not hooks
        assert disconnect["token_cancelled"] is None
        return
    assert len(hooks) == 1, events
    assert hooks[0]["close_code"] == disconnect["code"]
    assert disconnect["token_cancelled"] is True
    assert closed_at < hooks[0]["t"] <= done["t"]
    assert done["t"] - closed_at < CANCEL_BOUND
    scenario, fired = "ws chat (ends itself)", hooks[0]["t"]
    latencies.add(server.spec.name, scenario, leave, closed_at, stopped=done["t"], fired=fired)


# -- the handshake --------------------------------------------------------------------------------
def leave_handshake(server: Server, prefix: str, leave: str) -> tuple[str, float, list[Event]]:
    """A handshake the app waits HANDSHAKE_WAIT to accept, left once the app started: the
    session's id, the time of the close, and its events once the app ended."""
    rid = new_id()
    sock = start_handshake(server.port, f"/{prefix}/handshake?id={rid}&wait={HANDSHAKE_WAIT}")
    try:
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, leave)
        server.events.wait_for(rid, "exit", timeout=HANDSHAKE_WAIT + WATCHDOG)
    finally:
        sock.close()
    return rid, closed_at, server.events.of(rid)


@pytest.mark.parametrize("leave", DROPS)
def test_handshake_cancelled_when_its_client_leaves_before_accept(
    server: Server, leave: str, latencies: Latencies, deliveries: Deliveries
) -> None:
    rid, closed_at, events = leave_handshake(server, "wrapped", leave)
    if server.spec.name not in SILENT_BEFORE_ACCEPT:
        assert_session_cancelled(
            server, rid, closed_at, leave, latencies, "ws before accept", accepted=False
        )
        return  # (how the session ended is in the server's log: quiet_and_settled reads it)
    # The server says nothing until the app accepts: then the app, listening, gets the
    # disconnect at once and ends by itself; the token fires once.
    accepted, disconnect = one(events, "accepted"), one(events, "disconnect_message")
    assert accepted["t"] - closed_at >= HANDSHAKE_WAIT / 2
    assert disconnect["t"] - accepted["t"] < CANCEL_BOUND
    assert len(of(events, "hook")) == 1, events
    assert not of(events, "cancelled"), events
    deliveries.add_outcome(
        server.spec.name, f"left before accept, {leave}", "disconnect only after the accept"
    )


@pytest.mark.parametrize("leave", DROPS)
def test_handshake_waits_for_nobody_without_the_middleware(
    server: Server, leave: str, deliveries: Deliveries
) -> None:
    _, closed_at, events = leave_handshake(server, "bare", leave)
    assert not of(events, "cancelled"), events
    assert not of(events, "hook"), events
    # The whole wait, for nobody: then the accept raises, or succeeds and the disconnect follows.
    ended = (of(events, "send_failed") or of(events, "accepted"))[0]
    assert ended["t"] - closed_at >= HANDSHAKE_WAIT / 2
    outcome = (
        f"accept raised {ended['exc']}"
        if ended["event"] == "send_failed"
        else f"accept ok, then disconnect {one(events, 'disconnect_message')['code']}"
    )
    deliveries.add_outcome(server.spec.name, f"control: left before accept, {leave}", outcome)


# -- messages -------------------------------------------------------------------------------------
def assert_all_received(
    server: Server, rid: str, prefix: str, route: str, count: int, deliveries: Deliveries
) -> Event:
    events = server.events.of(rid)
    received = one(events, "received")
    deliveries.add_messages(
        server.spec.name, route, prefix, sent=count, lost=received["lost"],
        duplicated=received["duplicated"], reordered=received["reordered"],
    )  # fmt: skip
    assert (received["count"], received["lost"]) == (count, 0), received
    assert (received["duplicated"], received["reordered"]) == (0, 0), received
    return one(events, "held")


def assert_listener_ended(server: Server, rid: str) -> tuple[Event, Event]:
    """The app, listening, got the disconnect once and returned by itself, uncancelled: its
    disconnect message and its end."""
    exit_event = server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    events = server.events.of(rid)
    assert exit_event["outcome"] == "returned"
    assert not of(events, "cancelled"), events
    return one(events, "disconnect_message"), one(events, "done")


@pytest.mark.parametrize(
    ("route", "leave"), [("late", CLOSE_1000), ("late", RST), ("flood", CLOSE_1000)]
)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_messages_read_late_arrive_all_in_order(
    server: Server, prefix: str, route: str, leave: str, deliveries: Deliveries
) -> None:
    """The client sends numbered messages while the app holds off reading: 100, or a flood of
    6 MB of 1 KiB messages for half a second. The app then gets every one, once, in order; the
    client leaves once it was told so. The middleware reads all 100 ahead; of the flood it holds
    at most `read_ahead` (then the server's own backpressure applies, or daphne buffers them)."""
    rid = new_id()
    count, size, hold = MESSAGES[route]
    padding = b"x" * max(size - 6, 0)
    messages = b"".join(frame(TEXT, b"%05d " % number + padding) for number in range(count))
    with WebSocket.connect(server.port, f"/{prefix}/late?id={rid}&n={count}&hold={hold}") as ws:
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        ws.send_in_background(messages)
        assert ws.read_text() == f"received {count}"
        ws.wait_sent(WATCHDOG)
        ws.leave_politely(leave)
    held = assert_all_received(server, rid, prefix, route, count, deliveries)
    growth_mib = (held["rss_after_kib"] - held["rss_before_kib"]) / 1024
    deliveries.add_outcome(
        server.spec.name,
        f"{route}, {prefix}: most read ahead",
        f"{held['messages']} msgs / {held['bytes']} B, RSS +{growth_mib:.1f} MiB",
    )
    if prefix == "wrapped" and route == "late":  # all read ahead: the bound is far
        assert held["messages"] == count, held
    elif prefix == "wrapped":  # `read_ahead` is checked before each read: one message may pass
        assert 0 < held["bytes"] < WS_READ_AHEAD + MESSAGE_COST + size, held
    assert_listener_ended(server, rid)


# -- bad input ------------------------------------------------------------------------------------
def send_oversized(server: Server, prefix: str) -> tuple[str, str]:
    """What the client and the app each saw of a frame past the server's limit."""
    rid = new_id()
    with WebSocket.connect(server.port, f"/{prefix}/chat?id={rid}") as ws:
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        ws.send_in_background(frame(BINARY, bytes(OVERSIZE), zero_mask=True) + frame(TEXT, b"ok"))
        seen = ws.read_frame()
        if seen is not None and seen.opcode != CLOSE:
            client = f"answered {seen.payload.decode()!r}"
            ws.leave_politely(CLOSE_1000)
        else:
            client = "dropped" if seen is None else f"closed {seen.close_code}"
            # The frame may be half sent: no close frame can follow it. shutdown() also wakes
            # the sender thread (close() would not: its blocked send keeps the socket open).
            with contextlib.suppress(OSError):  # the server may have reset it already
                ws.sock.shutdown(socket.SHUT_RDWR)
    server.events.wait_for(rid, "exit", timeout=CLOSE_TIMEOUTS.get(server.spec.name, 0) + WATCHDOG)
    events = server.events.of(rid)
    assert not of(events, "cancelled"), events
    disconnect = one(events, "disconnect_message")
    return client, f"disconnect {disconnect['code']}"


def test_oversized_frame_meets_the_servers_own_limit(
    server: Server, deliveries: Deliveries
) -> None:
    """The server closes (1009) or takes the frame, as it does without the middleware; either
    way the app ends, and nothing hangs or logs an error."""
    with ThreadPoolExecutor(len(PREFIXES)) as pool:  # uvicorn-websockets: 10 s each
        seen = dict(zip(PREFIXES, pool.map(partial(send_oversized, server), PREFIXES), strict=True))
    assert seen["wrapped"] == seen["bare"]
    deliveries.add_outcome(
        server.spec.name, "oversized frame (16 MiB + 1)", " / ".join(seen["bare"])
    )


def test_half_sent_handshake_starts_nothing_and_blocks_nobody(
    server: Server, deliveries: Deliveries
) -> None:
    stalled = {prefix: new_id() for prefix in PREFIXES}
    socks = [
        start_handshake(server.port, f"/{prefix}/chat?id={rid}", partial=True)
        for prefix, rid in stalled.items()
    ]
    try:
        rid = new_id()
        with WebSocket.connect(server.port, f"/wrapped/chat?id={rid}") as ws:
            ws.send_text("meanwhile")
            assert ws.read_text() == "meanwhile"
            ws.leave_politely(CLOSE_1000)
        assert_listener_ended(server, rid)
        socks[0].settimeout(0.3)
        try:
            answer = socks[0].recv(65536)
        except TimeoutError:
            answer = None
        outcome = "waits" if answer is None else ("closed" if not answer else "answered")
        deliveries.add_outcome(server.spec.name, "half-sent handshake, 0.3 s", outcome)
    finally:
        for sock in socks:
            close(sock, RST)
    time.sleep(0.05)
    for rid in stalled.values():
        assert server.events.of(rid) == []
