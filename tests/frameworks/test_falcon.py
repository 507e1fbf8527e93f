"""Falcon ASGI under uvicorn, wrapped with the middleware and without."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..servers.runner import UVICORN_HTTPTOOLS, Server
from .harness import (
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

FRAMEWORK = "falcon"


@pytest.fixture(scope="module")
def with_mw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.falcon_app:app", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(UVICORN_HTTPTOOLS, "frameworks.falcon_app:control", tmp_path_factory) as server:
        yield server


def test_slow_responder_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    case = disconnect(with_mw, "/slow")
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "slow responder")
    assert_cleanup_once(case, "cancelled", "finally")
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_slow_responder_control(control: Server) -> None:
    """Without the middleware a Falcon responder runs to its end: Falcon does not watch for
    the disconnect while a responder runs."""
    case = disconnect(control, "/slow")
    assert_ran_to_end(case)
    assert_clean_log(control)
    assert_next_request_served(control)


def test_sse_cancelled(with_mw: Server, latencies: FrameworkLatencies) -> None:
    """Falcon watches for the disconnect while it streams `resp.sse` and closes the generator
    itself (`GeneratorExit`, not `CancelledError`); with the middleware the token fires too, and
    nothing is cancelled twice."""
    case = disconnect(with_mw, "/sse", stream=True)
    assert_cancelled_promptly(case, latencies, FRAMEWORK, "resp.sse", by="closed_by_framework")
    assert_cleanup_once(case, "closed_by_framework", "finally")
    assert not case.of("cancelled"), case.events
    assert case.one("exit")["outcome"] == "returned"
    assert_clean_log(with_mw)
    assert_next_request_served(with_mw)


def test_sse_control(control: Server) -> None:
    """Without the middleware Falcon stops an SSE stream itself, as promptly: the same as with
    it, minus the token."""
    case = disconnect(control, "/sse", stream=True)
    assert_self_cancelled(case, by="closed_by_framework")
    assert_cleanup_once(case, "closed_by_framework", "finally")
    assert_clean_log(control)
    assert_next_request_served(control)


def test_normal_response_identical(with_mw: Server, control: Server) -> None:
    with_response = fetch(with_mw.port, "/normal")
    control_response = fetch(control.port, "/normal")
    assert with_response.status == 200
    assert with_response.body == control_response.body
    assert stable_headers(with_response) == stable_headers(control_response)
    assert with_response.headers["x-matrix"] == "normal"
