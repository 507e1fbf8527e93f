"""FastAPI under uvicorn, with `app.add_middleware(CancelOnDisconnectMiddleware)` and without.

FastAPI (Starlette) never cancels an endpoint on a disconnect by itself: without the
middleware an async endpoint, a `def` endpoint in the threadpool and asgiref-bridged work all
run to their end. sse-starlette is the exception: it listens for the disconnect itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..servers.checks import WATCHDOG
from ..servers.client import FIN, close, connect, new_id, read_response, send_request
from ..servers.runner import UVICORN_HTTPTOOLS, Server
from .harness import (
    PROMPT,
    WORK,
    assert_after,
    assert_cancelled_promptly,
    assert_clean_log,
    assert_cleanup_once,
    assert_next_request_served,
    assert_ran_to_end,
    assert_self_cancelled,
    disconnect,
    fetch,
    serve,
    stable_headers,
)
from .latency import FrameworkLatencies

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

FRAMEWORK = "fastapi"
THREAD_EVENTS = ("exit", "thread_returned", "teardown")


@pytest.fixture(scope="module")
def with_mw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.fastapi_app:app", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.fastapi_app:control", tmp_path_factory) as server:
        yield server


def test_async_endpoint_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/slow")
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "async endpoint")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_async_endpoint_control(control: Server) -> None:
    """Without the middleware an async endpoint runs to its end for nobody."""
    case = disconnect(control, "/slow")
    assert_ran_to_end(case)
    assert_clean_log(control)
    assert_next_request_served(control)


def test_sse_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/sse", stream=True)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "sse-starlette")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sse_control(control: Server) -> None:
    """Without the middleware sse-starlette's `EventSourceResponse` notices the disconnect
    itself and cancels its generator, as promptly: the same as with it, minus the token."""
    case = disconnect(control, "/sse", stream=True)
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "finally")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_sync_endpoint_yield_dependency(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """A `def` endpoint using `db` from a `yield` dependency, in the threadpool: the token fires
    at once, the thread stops at its next check (and still rolls back with `db`); `db` is
    closed once, only after the thread returned, and never used after that."""
    case = disconnect(with_mw, "/sync-db", until=THREAD_EVENTS)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "def endpoint + yield dep", by="stopped")
    assert case.since_close("thread_returned") < PROMPT
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_after(case, "exit", "teardown")
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sync_endpoint_yield_dependency_control(control: Server) -> None:
    """Without the middleware the thread runs to its end; the teardown follows it."""
    case = disconnect(control, "/sync-db", until=THREAD_EVENTS)
    assert_ran_to_end(case)
    assert case.since_close("thread_returned") > WORK / 2
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_async_endpoint_yield_dependency(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """An async endpoint using `db`: cancelled at once; `db` is closed once, after the
    endpoint's own `except CancelledError` used it, never before."""
    case = disconnect(with_mw, "/async-db", until=("exit", "teardown"))
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "async endpoint + yield dep")
    assert_cleanup_once(case, "cancelled", "finally", "teardown")
    assert_after(case, "teardown", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_async_endpoint_yield_dependency_control(control: Server) -> None:
    """Without the middleware the endpoint runs to its end, then `db` is closed."""
    case = disconnect(control, "/async-db", until=("exit", "teardown"))
    assert_ran_to_end(case)
    assert_cleanup_once(case, "finally", "teardown")
    assert_after(case, "teardown", "done")
    assert_clean_log(control)
    assert_next_request_served(control)


@pytest.mark.parametrize("which", ["with", "control"])
def test_background_task_survives(with_mw: Server, control: Server, which: str) -> None:
    """A background task runs after the full response: a client that closes right after
    reading it cancels nothing, with the middleware (the token stays quiet) or without."""
    server = with_mw if which == "with" else control
    rid = new_id()
    with connect(server.port) as sock:
        send_request(sock, "GET", f"/bg?id={rid}")
        response = read_response(sock)
        close(sock, FIN)  # at once: the background task is still running
    assert (response.status, response.body) == (200, b"bg")
    bg_done = server.events.wait_for(rid, "bg_done", timeout=WATCHDOG)
    server.events.wait_for(rid, "exit", timeout=WATCHDOG)
    assert bg_done["token_cancelled"] is False
    assert not server.events.of(rid, "hook")
    assert not server.events.of(rid, "cancelled")
    assert_clean_log(server)
    assert_next_request_served(server)


def test_sync_to_async(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """asgiref `sync_to_async` work in a thread, using `db`: the token fires at once, the
    thread stops at its next check, and `db` is closed only after the thread returned."""
    case = disconnect(with_mw, "/sync-to-async", until=THREAD_EVENTS)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "sync_to_async + yield dep", by="stopped")
    assert case.since_close("thread_returned") < PROMPT
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_after(case, "exit", "teardown")
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sync_to_async_control(control: Server) -> None:
    """Without the middleware the thread runs to its end."""
    case = disconnect(control, "/sync-to-async", until=THREAD_EVENTS)
    assert_ran_to_end(case)
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_async_to_sync(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """A `def` endpoint running a coroutine with `async_to_sync` (on another event loop): the
    token reaches it there; it stops at its next check; the request ends after the thread."""
    case = disconnect(with_mw, "/async-to-sync", until=("exit", "thread_returned"))
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "async_to_sync", by="stopped")
    assert case.one("start")["in_other_loop"] is True
    assert case.since_close("thread_returned") < PROMPT
    assert_after(case, "exit", "thread_returned")
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_async_to_sync_control(control: Server) -> None:
    """Without the middleware the coroutine runs to its end."""
    case = disconnect(control, "/async-to-sync", until=("exit", "thread_returned"))
    assert_ran_to_end(case)
    assert_clean_log(control)
    assert_next_request_served(control)


def test_normal_response_identical(with_mw: Server, control: Server) -> None:
    with_response = fetch(with_mw.port, "/normal")
    control_response = fetch(control.port, "/normal")
    assert with_response.status == 200
    assert with_response.body == control_response.body
    assert stable_headers(with_response) == stable_headers(control_response)
    assert with_response.headers["x-matrix"] == "normal"
