"""Across hops: client -> gateway -> backend, each a real uvicorn process on 127.0.0.1.

The client closes its connection to the gateway. With asgi-cancel on the gateway (the
middleware, with or without `CancelTransport`) the backend sees its own client, the gateway,
leave and is cancelled, streaming and not. A gateway without asgi-cancel leaves a non-streaming
backend running to its end; Starlette's own stream listener (spec 2.3 on uvicorn) closes a
streamed one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from .checks import assert_cancelled, assert_not_cancelled, leave
from .client import connect, new_id, send_request
from .latency import Latencies
from .runner import UVICORN_HTTPTOOLS, Server, serving

pytestmark = [pytest.mark.servers, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(UVICORN_HTTPTOOLS, "tests.servers.apps:backend", tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(
    request: pytest.FixtureRequest, backend: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHAIN_BACKEND_PORT", str(backend.port))
        spec = replace(UVICORN_HTTPTOOLS, name=request.param)  # named in the latency table
        with serving(spec, f"tests.servers.apps:{request.param}", tmp_path_factory) as server:
            yield server


# Each gateway with asgi-cancel, streaming and not; and the one without it, whose stream
# Starlette's own listener closes.
LEAVING = [
    pytest.param(gateway, path, id=f"{gateway}-{kind}")
    for gateway in ("gateway", "gateway_aiohttp", "gateway_middleware_only", "gateway_plain")
    for path, kind in (("/slow", "non-streaming"), ("/stream", "streaming"))
    if gateway != "gateway_plain" or path == "/stream"
]


@pytest.mark.parametrize(("gateway", "path"), LEAVING, indirect=["gateway"])
def test_backend_cancelled_when_the_client_leaves_the_gateway(
    backend: Server, gateway: Server, path: str, latencies: Latencies
) -> None:
    """The client leaves the gateway mid-request: the backend is cancelled, as by any client."""
    rid = new_id()
    closed_at, _ = leave(backend, f"{path}?id={rid}", rid, stream=path == "/stream", via=gateway)
    scenario = f"chain: {gateway.spec.name} {path}"
    assert_cancelled(
        backend, rid, closed_at, latencies, scenario, response_started=path == "/stream"
    )
    gateway.assert_no_traceback()


@pytest.mark.parametrize("gateway", ["gateway_plain"], indirect=True)
def test_without_asgi_cancel_a_non_streaming_backend_runs_to_its_end(
    backend: Server, gateway: Server
) -> None:
    rid = new_id()
    leave(backend, f"/slow?id={rid}&t=1", rid, via=gateway)
    assert_not_cancelled(backend, rid, finished="done")


@pytest.mark.parametrize("gateway", ["gateway", "gateway_aiohttp"], indirect=True)
def test_the_request_id_reaches_the_backend(backend: Server, gateway: Server) -> None:
    rid = new_id()
    with connect(gateway.port) as sock:
        headers = (("X-Request-Id", f"chain-{rid}"),)
        send_request(sock, "GET", f"/slow?id={rid}&t=0.01", headers=headers)
        started = backend.events.wait_for(rid, "start", timeout=10)
    assert started["request_id"] == f"chain-{rid}"
