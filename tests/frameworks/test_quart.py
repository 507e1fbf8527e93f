"""Quart under hypercorn (its home) and uvicorn, wrapped with the middleware and without.

Quart runs its own receive loop and cancels its handler task once on `http.disconnect`, then
waits for it: the control cancels too, and its `except CancelledError` cleanup completes. With
the middleware the same must hold: the token fires at once, and no second cancellation cuts a
0.3 s or 2 s cleanup short.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..servers.checks import WATCHDOG
from ..servers.runner import HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS, Server, ServerSpec
from .harness import (
    WORK,
    assert_after,
    assert_cancelled_promptly,
    assert_clean_log,
    assert_cleanup_once,
    assert_next_request_served,
    assert_self_cancelled,
    disconnect,
    fetch,
    serve,
    stable_headers,
)
from .latency import FrameworkLatencies

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

FRAMEWORK = "quart"
SERVERS = [HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS]


@pytest.fixture(scope="module", params=SERVERS, ids=str)
def spec(request: pytest.FixtureRequest) -> ServerSpec:
    result: ServerSpec = request.param
    return result


@pytest.fixture(scope="module")
def with_mw(spec: ServerSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(spec, "frameworks.quart_app:app", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def control(spec: ServerSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(spec, "frameworks.quart_app:control", tmp_path_factory) as server:
        yield server


@pytest.mark.parametrize(
    "cleanup", [0.0, 0.3, 2.0], ids=["no-cleanup", "cleanup-0.3s", "cleanup-2s"]
)
def test_slow_handler_cleanup_completes(
    with_mw: Server, cleanup: float, latencies: FrameworkLatencies
) -> None:
    """Cancelled at once; an `except CancelledError` cleanup awaiting 0.3 s or 2 s completes,
    exactly once, and the request ends only after it (no second cancellation)."""
    case = disconnect(with_mw, "/slow", query=f"cleanup={cleanup}", timeout=cleanup + WATCHDOG)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "slow handler")
    expected = ("cancelled", "finally", "cleanup_done") if cleanup else ("cancelled", "finally")
    assert_cleanup_once(case, *expected)
    if cleanup:
        # asyncio may wake a timer up to its clock resolution early: a small tolerance.
        assert case.one("cleanup_done")["t"] - case.one("cancelled")["t"] >= cleanup * 0.99
        assert_after(case, "exit", "cleanup_done")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


@pytest.mark.parametrize("cleanup", [0.3, 2.0], ids=["cleanup-0.3s", "cleanup-2s"])
def test_slow_handler_control(control: Server, cleanup: float) -> None:
    """Without the middleware Quart cancels its handler itself, as promptly, and waits for the
    cleanup; the difference: no token for code that is not in the handler's task."""
    case = disconnect(control, "/slow", query=f"cleanup={cleanup}", timeout=cleanup + WATCHDOG)
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "finally", "cleanup_done")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(control)
    assert_next_request_served(control)


def test_streaming_response_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/stream", stream=True)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "streaming response")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_streaming_response_control(control: Server) -> None:
    """Without the middleware Quart stops a stream itself too."""
    case = disconnect(control, "/stream", stream=True)
    assert_self_cancelled(case)
    assert_cleanup_once(case, "cancelled", "finally")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_normal_response_identical(with_mw: Server, control: Server) -> None:
    with_response = fetch(with_mw.port, f"/normal?t={WORK}")
    control_response = fetch(control.port, f"/normal?t={WORK}")
    assert with_response.status == 200
    assert with_response.body == control_response.body
    assert stable_headers(with_response) == stable_headers(control_response)
    assert with_response.headers["x-matrix"] == "normal"
