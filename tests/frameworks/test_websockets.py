"""The frameworks' websocket endpoints under a real server, with the middleware installed the way
their users do it and without it (the control), and a client that really leaves (a close frame).

hypercorn (asyncio) for Starlette, FastAPI and Quart: its sends return normally once the client
has gone, so an endpoint busy sending runs on for nobody unless something stops it; daphne,
Channels' own server, for Django Channels. `WS_CASES` is the table: per framework and kind of
endpoint, how it ends with the middleware and alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..servers.checks import WATCHDOG, of, one
from ..servers.client import new_id
from ..servers.latency import Latencies
from ..servers.runner import DAPHNE, HYPERCORN_ASYNCIO, ServerSpec
from ..servers.ws_client import CLOSE_1000, WebSocket
from .deployment import MIDDLEWARE, Deploy, assert_clean_log

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

WORK = 1.0  # how long a busy endpoint sends when nobody stops it
RUNS_ON = "done"  # the control: it sends to its end, for nobody
CANCEL_BOUND = 0.5
ENDS = ("cancelled", "disconnected", RUNS_ON)
CHANNELS_MISSING = "Django Channels is not installed (`pip install channels`)"


@dataclass(frozen=True)
class WsCase:
    framework: str  # tests/frameworks/<framework>_app.py serves `app` and `control`
    scenario: str
    path: str
    stops: str  # how it ends with the middleware: one of ENDS
    alone: str  # ... and without it
    server: ServerSpec = HYPERCORN_ASYNCIO
    prompt: bool = False  # the client sends a message to start the work
    close_code: int = 1006  # what the server hands the app for a close frame 1000


BUSY, LISTENING = "busy endpoint", "listening endpoint"
WS_CASES = [
    WsCase("starlette", BUSY, "/ws/busy", stops="cancelled", alone=RUNS_ON),
    WsCase("starlette", LISTENING, "/ws/chat", stops="disconnected", alone="disconnected"),
    WsCase("fastapi", BUSY, "/ws/busy", stops="cancelled", alone=RUNS_ON),
    WsCase("fastapi", LISTENING, "/ws/chat", stops="disconnected", alone="disconnected"),
    # Quart reads the socket in a task of its own and cancels the handler once its client left.
    WsCase("quart", BUSY, "/ws/busy", stops="cancelled", alone="cancelled"),
    WsCase("quart", LISTENING, "/ws/chat", stops="cancelled", alone="cancelled"),
    # Channels dispatches one message at a time: a handler streaming a reply reads nothing.
    WsCase("channels", "busy consumer (a prompt, then a stream)", "/ws/busy", stops="cancelled",
           alone=RUNS_ON, server=DAPHNE, prompt=True, close_code=1000),
    WsCase("channels", "listening consumer", "/ws/chat", stops="disconnected",
           alone="disconnected", server=DAPHNE, close_code=1000),
]  # fmt: skip


@MIDDLEWARE
@pytest.mark.parametrize(
    "case", WS_CASES, ids=[f"{c.framework}-{c.server}-{c.scenario}" for c in WS_CASES]
)
def test_client_leaves_a_websocket(
    deploy: Deploy, case: WsCase, middleware: bool, latencies: Latencies
) -> None:
    """With the middleware the token fires once (the hook, with the server's close code) and
    the endpoint ends by the row's `stops`; without it, a busy endpoint sends to its end for
    nobody, unless its framework stops it. Its cleanup runs once; the app returns."""
    if case.framework == "channels":
        pytest.importorskip("channels", reason=CHANNELS_MISSING)
    server = deploy(case.framework, case.server)[middleware]
    rid = new_id()
    with WebSocket.connect(server.port, f"{case.path}?id={rid}&t={WORK}") as ws:
        if case.prompt:
            ws.send_text("a prompt")
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        if case.path == "/ws/chat":
            ws.send_text("hello")
            assert ws.read_text() == "hello"
        closed_at, _ = ws.leave_politely(CLOSE_1000)
    end = case.stops if middleware else case.alone
    server.events.wait_for(rid, "exit", timeout=WORK + WATCHDOG)
    events = server.events.of(rid)
    ended = one(events, end)
    for name in ENDS:
        assert name == end or not of(events, name), events
    one(events, "finally")
    assert one(events, "exit")["outcome"] == "returned"
    assert closed_at < ended["t"]
    if end == "disconnected":  # the server's code, as the middleware replays it
        assert ended["code"] == case.close_code, ended
    hooks = of(events, "hook")
    if middleware:
        assert len(hooks) == 1, events
        assert hooks[0]["reason"] == "client disconnected"
        assert hooks[0]["close_code"] == case.close_code
        assert ended["token_cancelled"] is True
        assert closed_at < hooks[0]["t"] <= ended["t"]
        assert ended["t"] - closed_at < CANCEL_BOUND
        scenario, fired = f"{case.framework}: websocket {case.scenario}", hooks[0]["t"]
        latencies.add(
            server.spec.name, scenario, CLOSE_1000, closed_at, stopped=ended["t"], fired=fired
        )
    else:
        assert not hooks, events
        assert ended.get("token_cancelled") is None  # no middleware, no token
        if end == RUNS_ON:
            assert ended["t"] - closed_at > WORK / 2, events
    assert_clean_log(server)
