"""Across hops: client -> gateway -> backend, each a real uvicorn process on 127.0.0.1.

The client closes its connection to the gateway; with the binding (`CancelTransport` on the
gateway, under the middleware) the backend's app is cancelled within a few ms of that close,
streaming and not. The control (a gateway without asgi-cancel) leaves the non-streaming
backend running; Starlette's own stream listener (spec 2.3 on uvicorn) closes a streamed one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from .client import FIN, close, connect, new_id, recv_some, send_request
from .runner import UVICORN_HTTPTOOLS, Server, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(90)]

CANCEL_WITHIN = 0.5  # the bar on a loaded 2-core machine; the measured figures are printed
RUNS_ON = 1.5  # the control: the backend is still running this long after the close


def report(what: str, latency: float) -> None:
    sys.stdout.write(f"\nchain {what}: client close -> backend cancelled {latency * 1e3:.1f} ms\n")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("backend")
    with running_server(UVICORN_HTTPTOOLS, "servers.chain_app:backend", workdir) as server:
        yield server


def gateway(
    target: str, backend: Server, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> AbstractContextManager[Server]:
    monkeypatch.setenv("CHAIN_BACKEND_PORT", str(backend.port))
    return running_server(UVICORN_HTTPTOOLS, f"servers.chain_app:{target}", workdir)


def leave_mid_request(gateway_port: int, backend: Server, path: str) -> tuple[str, float]:
    """Start a request through the gateway, close once the backend works on it."""
    request_id = new_id()
    sock = connect(gateway_port)
    send_request(sock, "GET", f"{path}?id={request_id}")
    backend.events.wait_for(request_id, "started", timeout=10)
    if path == "/stream":
        assert recv_some(sock)  # the stream reached the client
    time.sleep(0.05)
    return request_id, close(sock, FIN)


@pytest.mark.parametrize("path", ["/slow", "/stream"], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("target", ["gateway", "gateway_middleware_only"])
def test_the_backend_is_cancelled_when_the_client_leaves_the_gateway(
    backend: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, target: str
) -> None:
    with gateway(target, backend, tmp_path, monkeypatch) as front:
        request_id, closed_at = leave_mid_request(front.port, backend, path)
        cancelled = backend.events.wait_for(request_id, "cancelled", timeout=10)
        latency = cancelled["t"] - closed_at
        report(f"{target} {path}", latency)
        assert latency < CANCEL_WITHIN
        front.assert_no_traceback()
    backend.assert_no_traceback()


def test_without_the_binding_a_non_streaming_backend_runs_on(
    backend: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with gateway("gateway_plain", backend, tmp_path, monkeypatch) as front:
        request_id, _ = leave_mid_request(front.port, backend, "/slow")
        time.sleep(RUNS_ON)
        assert backend.events.of(request_id, "cancelled") == []


def test_without_the_binding_a_stream_is_closed_by_starlette_itself(
    backend: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with gateway("gateway_plain", backend, tmp_path, monkeypatch) as front:
        request_id, closed_at = leave_mid_request(front.port, backend, "/stream")
        cancelled = backend.events.wait_for(request_id, "cancelled", timeout=10)
        latency = cancelled["t"] - closed_at
        report("gateway_plain /stream", latency)


def test_the_request_id_reaches_the_backend(
    backend: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with gateway("gateway", backend, tmp_path, monkeypatch) as front:
        request_id = new_id()
        sock = connect(front.port)
        headers = (("X-Request-Id", f"chain-{request_id}"),)
        send_request(sock, "GET", f"/slow?id={request_id}&t=0.01", headers=headers)
        started = backend.events.wait_for(request_id, "started", timeout=10)
        sock.close()
        assert started["upstream_id"] == f"chain-{request_id}"
