"""The framework matrix: each framework's app under a real server, with the middleware installed
the way its users do it and without it (the control), and a client that really leaves (FIN).

`CASES` is the table: per framework and kind of work, how the work stops with the middleware,
what the framework does alone, which cleanups run once and in which order. One test per
contract line runs over it; each also checks the log (no traceback, no 500) and that the server
serves the next request.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..servers.checks import WATCHDOG, assert_not_cancelled, leave, of, one
from ..servers.client import FIN, close, connect, fetch, new_id, read_response, send_request
from ..servers.latency import Latencies
from ..servers.runner import HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS, ServerSpec
from .deployment import MIDDLEWARE, Deploy, assert_clean_log

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

# How long the slow endpoints work when nobody stops them: the control runs to the end within
# the test, and a cancelled request is far from its end.
WORK = 1.0
RUNS_ON = "done"  # the control: the work runs to its end, for nobody
STOP_EVENTS = ("cancelled", "stopped", "closed_by_framework")
# Headers that differ between two responses for reasons other than the middleware.
VOLATILE = frozenset({"date", "server", "connection", "keep-alive"})


@dataclass(frozen=True)
class Case:
    framework: str  # tests/frameworks/<framework>_app.py serves `app` and `control`
    scenario: str
    path: str
    stops: str = "cancelled"  # its event with the middleware: one of STOP_EVENTS
    alone: str = RUNS_ON  # the control: RUNS_ON, or SELF (the framework stops it, as `stops`)
    stream: bool = False
    query: str = ""
    once: tuple[str, ...] = ("finally",)  # cleanups that run exactly once, both ways
    order: tuple[tuple[str, str], ...] = ()  # (earlier, later), both ways
    thread: bool = False  # work in a worker thread: the token fires first, then it stops
    server: ServerSpec = UVICORN_HTTPTOOLS


SELF = "self"  # `alone=SELF`: the framework listens for the disconnect and stops the work itself
CLEANUP, AFTER_CLEANUP = ("cleanup_done", "finally"), (("cleanup_done", "exit"),)
IN_THREAD, AFTER_THREAD = ("thread_returned",), (("thread_returned", "exit"),)
DB_IN_THREAD = ("thread_returned", "teardown")  # the teardown only once the thread returned
AFTER_DB = (("thread_returned", "teardown"), ("teardown", "exit"))

CASES = [
    # Django cancels an async view itself, then waits for it: its cleanup completes.
    Case("django", "async view, 0.3 s cleanup", "/slow", alone=SELF, query="cleanup=0.3",
         once=CLEANUP, order=AFTER_CLEANUP),
    Case("django", "StreamingHttpResponse", "/stream", alone=SELF, stream=True),
    Case("django", "sync view (thread)", "/sync", stops="stopped", thread=True, once=IN_THREAD),
    Case("falcon", "slow responder", "/slow"),
    # Falcon closes the generator of `resp.sse` itself (GeneratorExit, no CancelledError).
    Case("falcon", "resp.sse", "/sse", stops="closed_by_framework", alone=SELF, stream=True),
    Case("fastapi", "async endpoint", "/slow"),
    Case("fastapi", "async endpoint + yield dep", "/async-db", once=("finally", "teardown"),
         order=(("finally", "teardown"),)),
    Case("fastapi", "StreamingResponse", "/stream", alone=SELF, stream=True),
    Case("fastapi", "sse-starlette", "/sse", alone=SELF, stream=True),
    Case("fastapi", "def endpoint + yield dep (thread)", "/sync-db", stops="stopped",
         thread=True, once=DB_IN_THREAD, order=AFTER_DB),
    Case("fastapi", "def endpoint + yield dep, raise_if_cancelled (thread)", "/sync-db",
         query="check=raise", thread=True, once=DB_IN_THREAD, order=AFTER_DB),
    Case("fastapi", "sync_to_async + yield dep (thread)", "/sync-to-async", stops="stopped",
         thread=True, once=DB_IN_THREAD, order=AFTER_DB),
    Case("fastapi", "async_to_sync (another loop, thread)", "/async-to-sync", stops="stopped",
         thread=True, once=IN_THREAD, order=AFTER_THREAD),
    Case("litestar", "async handler", "/slow"),
    Case("litestar", "Stream", "/stream", alone=SELF, stream=True),
    Case("litestar", "sync_to_thread + dependency (thread)", "/sync", stops="stopped",
         thread=True, once=DB_IN_THREAD, order=AFTER_DB),
    # Quart cancels its handler itself, then waits for it: a cleanup of 0.3 s or 2 s (far past
    # `grace`) completes, with the middleware as without it.
    *(case for server in (HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS) for case in (
        Case("quart", "slow handler", "/slow", alone=SELF, server=server),
        Case("quart", "slow handler, 0.3 s cleanup", "/slow", alone=SELF, query="cleanup=0.3",
             once=CLEANUP, order=AFTER_CLEANUP, server=server),
        Case("quart", "slow handler, 2.0 s cleanup", "/slow", alone=SELF, query="cleanup=2.0",
             once=CLEANUP, order=AFTER_CLEANUP, server=server),
        Case("quart", "streaming response", "/stream", alone=SELF, stream=True, server=server),
    )),
    Case("starlette", "async endpoint", "/slow"),
    # Below spec 2.4 (uvicorn: 2.3) Starlette listens for the disconnect itself.
    Case("starlette", "StreamingResponse", "/stream", alone=SELF, stream=True),
    Case("basehttp", "async endpoint", "/slow"),
    Case("basehttp", "StreamingResponse", "/stream", alone=SELF, stream=True),
]  # fmt: skip
DEPLOYMENTS = list(dict.fromkeys((case.framework, case.server) for case in CASES))
WITH_BACKGROUND_TASKS = ["fastapi", "starlette", "basehttp"]


@MIDDLEWARE
@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c.framework}-{c.server}-{c.scenario}" for c in CASES]
)
def test_client_leaves(deploy: Deploy, case: Case, middleware: bool, latencies: Latencies) -> None:
    """With the middleware the token fires (the hook, with the client's reason) and the work
    stops before its end, by the row's `stops`; without it, the work runs to its end or the
    framework stops it itself. Either way nothing is stopped twice, every cleanup runs once
    in order, no resource is used after its teardown, and the app returns to the server."""
    server = deploy(case.framework, case.server)[middleware]
    rid = new_id()
    target = f"{case.path}?id={rid}&t={WORK}" + (f"&{case.query}" if case.query else "")
    closed_at, _ = leave(server, target, rid, stream=case.stream)
    stop = case.stops if middleware or case.alone == SELF else RUNS_ON
    for name in ("exit", stop, *case.once, *(name for pair in case.order for name in pair)):
        server.events.wait_for(rid, name, timeout=WORK + WATCHDOG)
    events = server.events.of(rid)

    stopped = one(events, stop)
    for name in (*STOP_EVENTS, RUNS_ON):
        assert name == stop or not of(events, name), events
    for name in case.once:
        one(events, name)
    for earlier, later in case.order:
        assert one(events, earlier)["t"] <= one(events, later)["t"], events
    assert not of(events, "used_after_close"), events
    assert not any(teardown["already_closed"] for teardown in of(events, "teardown")), events
    assert one(events, "exit")["outcome"] == "returned"
    assert closed_at < stopped["t"]
    hooks = of(events, "hook")
    if middleware:
        assert len(hooks) == 1, events
        assert hooks[0]["reason"] == "client disconnected"
        assert stopped["token_cancelled"] is True
        # The token fires at once, before the cancellation lands; a worker thread may see
        # the flag before the hook has run.
        assert closed_at < hooks[0]["t"]
        assert case.thread or hooks[0]["t"] <= stopped["t"]
        scenario, fired = f"{case.framework}: {case.scenario}", hooks[0]["t"]
        latencies.add(server.spec.name, scenario, FIN, closed_at, stopped=stopped["t"], fired=fired)
    else:
        assert not hooks, events
        assert stopped.get("token_cancelled") is None  # no middleware, no token
    assert_clean_log(server)


@MIDDLEWARE
@pytest.mark.parametrize("framework", WITH_BACKGROUND_TASKS)
def test_background_task_survives(deploy: Deploy, framework: str, middleware: bool) -> None:
    """A background task runs after the full response: a client that closes right after
    reading it cancels nothing, with the middleware (the token stays quiet) or without."""
    server = deploy(framework, UVICORN_HTTPTOOLS)[middleware]
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}")
        response = read_response(sock)
        close(sock, FIN)  # at once: the background task is still running
    assert (response.status, response.body) == (200, b"bg")
    bg_done = assert_not_cancelled(server, rid, finished="bg_done")
    assert bg_done["token_cancelled"] is (False if middleware else None)
    assert_clean_log(server)


@pytest.mark.parametrize(
    ("framework", "spec"), DEPLOYMENTS, ids=[f"{f}-{s}" for f, s in DEPLOYMENTS]
)
def test_client_that_stays(deploy: Deploy, framework: str, spec: ServerSpec) -> None:
    """A request nobody leaves: status, headers and body are the same with and without the
    middleware, and a short slow request completes, cancelled by nothing."""
    server = deploy(framework, spec)
    ours, theirs = (fetch(server[m].port, "GET", "/normal") for m in (True, False))
    assert (ours.status, ours.headers["x-matrix"]) == (200, "normal")
    assert (ours.status, ours.body) == (theirs.status, theirs.body)
    stable = [{k: v for k, v in r.headers.items() if k not in VOLATILE} for r in (ours, theirs)]
    assert stable[0] == stable[1]
    rid = new_id()
    response = fetch(server[True].port, "GET", f"/slow?id={rid}&t=0.05")
    assert (response.status, response.body) == (200, b"slow done")
    assert_not_cancelled(server[True], rid, finished="done")
