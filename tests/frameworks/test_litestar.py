"""Litestar under uvicorn, wrapped with the middleware and without."""

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

FRAMEWORK = "litestar"


@pytest.fixture(scope="module")
def with_mw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.litestar_app:app", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.litestar_app:control", tmp_path_factory) as server:
        yield server


def test_async_handler_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/slow")
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "async handler")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_async_handler_control(control: Server) -> None:
    """Without the middleware an async handler runs to its end."""
    case = disconnect(control, "/slow")
    assert_ran_to_end(case)
    assert_clean_log(control)
    assert_next_request_served(control)


def test_stream_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/stream", stream=True)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "Stream")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_stream_control(control: Server) -> None:
    """Without the middleware Litestar's `Stream` listens for the disconnect itself and
    cancels its iteration (an anyio task group), as promptly."""
    case = disconnect(control, "/stream", stream=True)
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "finally")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_sync_to_thread_handler_with_yield_dependency(
    with_mw: Server, latencies: FrameworkLatencies
) -> None:
    """A `sync_to_thread=True` handler using a resource from a generator dependency: the token
    fires at once and the thread stops at its next check; the dependency's teardown runs
    once, only after the thread returned, and the resource is never used after it."""
    case = disconnect(with_mw, "/sync", until=("exit", "thread_returned", "teardown"))
    assert_cancelled_promptly(
        case, latencies, FRAMEWORK, "sync_to_thread + dependency", by="stopped"
    )
    assert case.since_close("thread_returned") < PROMPT
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_after(case, "exit", "teardown")
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sync_to_thread_handler_control(control: Server) -> None:
    """Without the middleware the thread runs to its end, then the teardown runs."""
    case = disconnect(control, "/sync", until=("exit", "thread_returned", "teardown"))
    assert_ran_to_end(case)
    assert case.since_close("thread_returned") > WORK / 2
    assert_cleanup_once(case, "teardown", "thread_returned")
    assert_after(case, "teardown", "thread_returned")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_normal_response_identical(with_mw: Server, control: Server) -> None:
    with_response = fetch(with_mw.port, "/normal")
    control_response = fetch(control.port, "/normal")
    assert with_response.status == 200
    assert with_response.body == control_response.body
    assert stable_headers(with_response) == stable_headers(control_response)
    assert with_response.headers["x-matrix"] == "normal"
