"""Framework apps under real servers: Starlette and FastAPI under uvicorn, Quart under hypercorn.

The middleware is installed the way users do it (`app.add_middleware(...)`, or wrapping the
Quart app); each test asserts the endpoint was cancelled, or on the good path that it was not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .checks import WATCHDOG, assert_cancelled, assert_not_cancelled
from .client import (
    CHUNK_MARKER,
    FIN,
    close,
    connect,
    get,
    new_id,
    read_head,
    read_response,
    read_until_count,
    send_request,
)
from .latency import Latencies
from .runner import HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

FRAMEWORKS = ["starlette", "basehttp", "fastapi"]
FRAMEWORK_IDS = ["starlette", "starlette-basehttpmiddleware", "fastapi"]


@pytest.fixture(scope="module")
def framework_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir: Path = tmp_path_factory.mktemp("frameworks")
    with running_server(UVICORN_HTTPTOOLS, "servers.framework_apps:app", workdir) as server:
        for framework in FRAMEWORKS:  # the first request builds each app's middleware stack
            assert get(server.port, f"/{framework}/hello").status == 200
        yield server
        server.assert_no_traceback()


@pytest.fixture(scope="module")
def quart_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir: Path = tmp_path_factory.mktemp("quart")
    with running_server(HYPERCORN_ASYNCIO, "servers.quart_app:app", workdir) as server:
        yield server
        server.assert_no_traceback()


def cancel_slow_request(server: Server, target: str, rid: str, latencies: Latencies) -> None:
    with connect(server.port) as sock:
        send_request(sock, "GET", target)
        server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, FIN)
        assert_cancelled(
            server,
            rid,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario=target.split("?")[0].strip("/").replace("/", "-"),
            close=FIN,
        )


@pytest.mark.parametrize("framework", FRAMEWORKS, ids=FRAMEWORK_IDS)
def test_slow_endpoint_cancelled_on_close(
    framework_server: Server, framework: str, latencies: Latencies
) -> None:
    rid = new_id()
    cancel_slow_request(framework_server, f"/{framework}/slow?id={rid}", rid, latencies)


@pytest.mark.parametrize("framework", FRAMEWORKS, ids=FRAMEWORK_IDS)
def test_streaming_response_cancelled_on_close(
    framework_server: Server, framework: str, latencies: Latencies
) -> None:
    rid = new_id()
    with connect(framework_server.port) as sock:
        send_request(sock, "GET", f"/{framework}/stream?id={rid}")
        status, _, body = read_head(sock)
        assert status == 200
        read_until_count(sock, CHUNK_MARKER, 3, body)
        closed_at = close(sock, FIN)
        assert_cancelled(
            framework_server,
            rid,
            closed_at=closed_at,
            response_started=True,
            latencies=latencies,
            scenario=f"{framework}-stream",
            close=FIN,
        )


@pytest.mark.parametrize("framework", FRAMEWORKS, ids=FRAMEWORK_IDS)
def test_background_task_survives_normal_request(framework_server: Server, framework: str) -> None:
    rid = new_id()
    with connect(framework_server.port) as sock:
        send_request(sock, "GET", f"/{framework}/bg?id={rid}")
        response = read_response(sock)
        close(sock, FIN)  # at once: the background task is still running
    assert (response.status, response.body) == (200, b"bg")
    bg_done = assert_not_cancelled(framework_server, rid, finished="bg_done")
    assert bg_done["token_cancelled"] is False


@pytest.mark.parametrize(
    ("mode", "exceptions"),
    [("raise", ("CancelledError",)), ("flag", ("none",))],
    ids=["raise_if_cancelled", "cancelled-flag"],
)
def test_sync_endpoint_stops_polling_token(
    framework_server: Server, mode: str, exceptions: tuple[str, ...], latencies: Latencies
) -> None:
    rid = new_id()
    with connect(framework_server.port) as sock:
        send_request(sock, "GET", f"/fastapi/sync?id={rid}&mode={mode}")
        framework_server.events.wait_for(rid, "start", timeout=WATCHDOG)
        closed_at = close(sock, FIN)
        assert_cancelled(
            framework_server,
            rid,
            closed_at=closed_at,
            response_started=False,
            latencies=latencies,
            scenario=f"fastapi-sync-{mode}",
            close=FIN,
            exceptions=exceptions,
        )


@pytest.mark.parametrize("framework", FRAMEWORKS, ids=FRAMEWORK_IDS)
def test_normal_request_not_cancelled(framework_server: Server, framework: str) -> None:
    rid = new_id()
    response = get(framework_server.port, f"/{framework}/slow?id={rid}&t=0.05")
    assert (response.status, response.body) == (200, b"slow done")
    assert_not_cancelled(framework_server, rid, finished="done")


def test_quart_slow_endpoint_cancelled_on_close(quart_server: Server, latencies: Latencies) -> None:
    rid = new_id()
    cancel_slow_request(quart_server, f"/quart/slow?id={rid}", rid, latencies)


def test_quart_normal_request_not_cancelled(quart_server: Server) -> None:
    rid = new_id()
    response = get(quart_server.port, f"/quart/slow?id={rid}&t=0.05")
    assert (response.status, response.body) == (200, b"slow done")
    assert_not_cancelled(quart_server, rid, finished="done")
