"""Deadlines: `x-request-timeout` (or `--timeout`) ends a request with the middleware's 504."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from example_app.gateway_cli import GatewayProcess
from example_app.launch import ServerProcess

from .helpers import completion_body, delta, request, stats, wait_idle

pytestmark = pytest.mark.timeout(90)

LONG = 2000  # tokens: 4 s at the api_server's 2 ms steps


def timed_completion(port: int, max_tokens: int, **headers: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    status, _, body = request(port, "POST", "/v1/completions", completion_body(max_tokens), headers)
    return status, body, time.monotonic() - started


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_the_timeout_header_ends_the_request_and_its_engine_work(
    api_server: ServerProcess, stream: bool
) -> None:
    before = stats(api_server)
    body = completion_body(LONG, stream=stream)
    started = time.monotonic()
    headers = {"x-request-timeout": "500ms"}
    status, _, answer = request(api_server.port, "POST", "/v1/completions", body, headers)
    elapsed = time.monotonic() - started
    if stream:  # the stream had started: it is ended, without its [DONE]
        assert status == 200
        assert answer.startswith(b"data: ")
        assert b"[DONE]" not in answer
    else:
        assert status == 504, answer
    assert 0.5 <= elapsed < 3.0
    after = wait_idle(api_server)
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "tokens_generated") < LONG


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerProcess]:
    args = ("--step-time", "0.002", "--timeout", "0.5", "--timeout-header", "x-budget")
    with ServerProcess(*args, "--log-level", "warning", server="uvicorn") as process:
        yield process


def test_timeout_is_a_deadline_for_every_request(strict_server: ServerProcess) -> None:
    status, _, elapsed = timed_completion(strict_server.port, LONG)
    assert status == 504
    assert 0.5 <= elapsed < 3.0


def test_timeout_header_names_the_header_read(strict_server: ServerProcess) -> None:
    assert timed_completion(strict_server.port, 100, **{"x-budget": "0.1s"})[0] == 504
    # 30 tokens, 60 ms: well within --timeout, past the budget in the header not read.
    assert timed_completion(strict_server.port, 30, **{"x-request-timeout": "0.01s"})[0] == 200


def test_the_gateway_answers_504_and_the_backend_stops(api_server: ServerProcess) -> None:
    before = stats(api_server)
    with GatewayProcess([api_server.base_url]) as gateway:
        status, _, elapsed = timed_completion(gateway.port, LONG, **{"x-request-timeout": "0.5"})
    assert status == 504
    assert 0.5 <= elapsed < 3.0
    after = wait_idle(api_server)
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "tokens_generated") < LONG
