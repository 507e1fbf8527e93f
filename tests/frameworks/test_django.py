"""Django 5 under uvicorn, with the middleware wrapping its ASGI application and without.

Django's ASGI handler listens for `http.disconnect` itself and cancels the view's task once
(async views, `StreamingHttpResponse`), so the control cancels too; what the middleware adds
there is the token (sync views in threads can stop) and nothing else: it must not cancel a
second time while the view's cleanup runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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

FRAMEWORK = "django"
CLEANUP = 0.3


@pytest.fixture(scope="module")
def with_mw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.django_app:app", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.django_app:control", tmp_path_factory) as server:
        yield server


def test_async_view_cleanup_completes(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """The view is cancelled at once and its 0.3 s `except CancelledError` cleanup completes:
    no second cancellation from the middleware cuts it short."""
    case = disconnect(with_mw, "/slow", query=f"cleanup={CLEANUP}")
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "async view")
    assert_cleanup_once(case, "cancelled", "cleanup_done", "finally")
    # asyncio's timers may fire up to the clock resolution early: 0.99, not 1.0.
    assert case.one("cleanup_done")["t"] - case.one("cancelled")["t"] >= CLEANUP * 0.99
    assert case.one("exit")["outcome"] == "returned"
    assert_after(case, "exit", "cleanup_done")
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_async_view_control(control: Server) -> None:
    """Without the middleware Django cancels the view itself, as promptly, and its cleanup
    completes; the difference: no token (`token_cancelled` False, no hook)."""
    case = disconnect(control, "/slow", query=f"cleanup={CLEANUP}")
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "cleanup_done", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(control)
    assert_next_request_served(control)


def test_streaming_response_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """A `StreamingHttpResponse` over an async iterator stops at once; its `finally` runs once."""
    case = disconnect(with_mw, "/stream", stream=True)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "StreamingHttpResponse")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_streaming_response_control(control: Server) -> None:
    """Without the middleware Django stops the stream itself, as promptly."""
    case = disconnect(control, "/stream", stream=True)
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "finally")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_sync_view_stops_on_token(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """A sync view runs in asgiref's thread; `current_token()` works there, fires at once, and
    the view's loop stops at its next check instead of running its whole second."""
    case = disconnect(with_mw, "/sync", until=("exit", "thread_returned"))
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "sync view (thread)", by="stopped")
    assert case.one("start")["in_thread"] is True
    assert case.since_close("thread_returned") < PROMPT
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sync_view_control(control: Server) -> None:
    """Without the middleware the thread cannot be told: it runs to its end (Django has
    already given up on the request and cancelled its task)."""
    case = disconnect(control, "/sync", until=("exit", "thread_returned"))
    assert_ran_to_end(case)
    assert case.since_close("thread_returned") > WORK / 2
    assert_clean_log(control)
    assert_next_request_served(control)


def test_normal_response_identical(with_mw: Server, control: Server) -> None:
    """A request nobody leaves: status, headers and body are the same with and without."""
    with_response = fetch(with_mw.port, "/normal")
    control_response = fetch(control.port, "/normal")
    assert with_response.status == 200
    assert with_response.body == control_response.body
    assert stable_headers(with_response) == stable_headers(control_response)
    assert with_response.headers["x-matrix"] == "normal"
