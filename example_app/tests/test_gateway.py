"""`python -m example_app gateway` and the cancel-by-id endpoint, as real processes on 127.0.0.1
(a client leaving the gateway, and nginx in front: test_gateway_chain.py)."""

from __future__ import annotations

import http.client
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import openai
import pytest

from example_app.gateway_cli import GatewayProcess
from example_app.launch import ServerProcess, free_port
from example_app.options import REDIS_ENV, SECRET_ENV

from .helpers import MODEL, WATCHDOG, completion_body, request, stats, wait_idle

pytestmark = pytest.mark.timeout(90)

SECRET = secrets.token_hex(8)
CANCEL_ARGS = ("--step-time", "0.01", "--log-level", "warning", "--cancel-endpoint")


@pytest.fixture(scope="module")
def backends() -> Iterator[list[ServerProcess]]:
    with (
        ServerProcess(*CANCEL_ARGS, env={SECRET_ENV: SECRET}) as first,
        ServerProcess(*CANCEL_ARGS) as second,
    ):
        yield [first, second]


@pytest.fixture(scope="module")
def gateway(backends: list[ServerProcess]) -> Iterator[GatewayProcess]:
    urls = [backend.base_url for backend in backends]
    with GatewayProcess(urls, "--cancel-endpoint", env={SECRET_ENV: SECRET}) as process:
        yield process


def send(port: int, request_id: str) -> http.client.HTTPConnection:
    """A completion of 1000 tokens (10 s) with `X-Request-Id: request_id`, not yet answered."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WATCHDOG)
    headers = {"x-request-id": request_id}
    connection.request("POST", "/v1/completions", completion_body(1000), headers)
    return connection


def wait_running(servers: list[ServerProcess], count: int) -> None:
    deadline = time.monotonic() + WATCHDOG
    while sum(stats(server)["requests_running"] for server in servers) != count:
        assert time.monotonic() < deadline, f"never {count} running"
        time.sleep(0.005)


def test_the_gateway_balances_and_sums_the_backends_metrics(
    gateway: GatewayProcess, backends: list[ServerProcess]
) -> None:
    before = [stats(backend)["requests_total"] for backend in backends]
    url = f"{gateway.base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=WATCHDOG) as client:
        for _ in range(4):  # one at a time: round-robin among equally loaded backends
            completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 3
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert sum(bool(chunk.choices and chunk.choices[0].delta.content) for chunk in chunks) == 3
    after = [stats(backend)["requests_total"] for backend in backends]
    assert sorted(b - a for a, b in zip(before, after, strict=True)) == [2, 3]
    assert stats(gateway)["requests_total"] == sum(after)
    health = json.loads(request(gateway.port, "GET", "/health")[2])
    assert health == {"status": "ok", "backends": [b.base_url for b in backends], "binding": True}


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_the_gateway_answers_with_one_date_and_one_server_header(
    gateway: GatewayProcess, stream: bool
) -> None:
    # The backend's own are not passed on: the gateway's server adds them.
    body = completion_body(2, stream=stream)
    status, headers, _ = request(gateway.port, "POST", "/v1/completions", body)
    assert status == 200
    assert (len(headers.get_all("date") or []), headers.get_all("server")) == (1, ["uvicorn"])


def test_the_cancel_endpoint_needs_the_secret_and_stops_the_request(
    backends: list[ServerProcess],
) -> None:
    backend = backends[0]
    aborted = stats(backend)["requests_aborted_total"]
    with closing(send(backend.port, "by-id-1")) as pending:
        wait_running([backend], 1)
        path = "/v1/requests/by-id-1"
        assert request(backend.port, "DELETE", path)[0] == 403
        assert request(backend.port, "DELETE", path, headers={"x-cancel-secret": "no"})[0] == 403
        right = {"x-cancel-secret": SECRET}
        answer = request(backend.port, "DELETE", path, headers=right)
        assert (answer[0], json.loads(answer[2])) == (200, {"id": "by-id-1", "cancelled": True})
        assert pending.getresponse().status == 499
    assert wait_idle(backend)["requests_aborted_total"] == aborted + 1
    again = request(backend.port, "DELETE", path, headers=right)
    assert (again[0], json.loads(again[2])) == (404, {"id": "by-id-1", "cancelled": False})


@pytest.mark.parametrize("where", ["gateway", "backend"])
def test_a_request_through_the_gateway_is_cancelled_by_its_id(
    gateway: GatewayProcess, backends: list[ServerProcess], where: str
) -> None:
    """At the gateway, or at the backend: the client's X-Request-Id was forwarded."""
    aborted = sum(stats(backend)["requests_aborted_total"] for backend in backends)
    ports = [gateway.port] if where == "gateway" else [backend.port for backend in backends]
    with closing(send(gateway.port, f"by-id-{where}")) as pending:
        wait_running(backends, 1)
        path, headers = f"/v1/requests/by-id-{where}/cancel", {"x-cancel-secret": SECRET}
        answers = sorted(request(port, "POST", path, headers=headers)[0] for port in ports)
        assert answers == [200, 404][: len(ports)]
        assert pending.getresponse().status == 499  # the gateway's, or the backend's passed on
    after = sum(wait_idle(backend)["requests_aborted_total"] for backend in backends)
    assert after == aborted + 1


def test_the_cancel_endpoint_is_off_by_default() -> None:
    with ServerProcess("--log-level", "warning") as backend:
        status, _, body = request(backend.port, "DELETE", "/v1/requests/x")
    assert status == 404
    assert "error" in json.loads(body)


def test_the_secret_reaches_started_backends_through_the_environment_only() -> None:
    secret = secrets.token_hex(16)
    args = ("--backends", "1", "--cancel-endpoint")
    with GatewayProcess([], *args, env={SECRET_ENV: secret}) as process:
        (url,) = json.loads(request(process.port, "GET", "/health")[2])["backends"]
        port = int(url.rpartition(":")[2])
        assert request(port, "DELETE", "/v1/requests/x")[0] == 403
        assert (
            request(port, "DELETE", "/v1/requests/x", headers={"x-cancel-secret": secret})[0] == 404
        )
        # Not in any process's command line, which `ps` shows to every user.
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert secret.encode() not in cmdline.read_bytes(), cmdline
            except OSError:  # the process has exited
                pass


def test_an_unreachable_backend_is_a_502() -> None:
    with GatewayProcess([f"http://127.0.0.1:{free_port()}"]) as gateway:
        status, _, body = request(gateway.port, "POST", "/v1/completions", completion_body(3))
        assert status == 502
        assert json.loads(body)["error"]["type"] == "server_error"
        assert "Traceback" not in gateway.log_text()


def test_with_a_redis_a_cancel_through_either_server_stops_the_request(tmp_path: Path) -> None:
    """`ASGI_CANCEL_REDIS_URL`: two example servers on one Redis are one deployment."""
    from tests.redis_server import running_redis

    with running_redis(tmp_path) as redis:
        env = {REDIS_ENV: redis.url}
        with (
            ServerProcess(*CANCEL_ARGS, env=env) as holder,
            ServerProcess(*CANCEL_ARGS, env=env) as other,
        ):
            aborted = stats(holder)["requests_aborted_total"]
            with closing(send(holder.port, "across-1")) as pending:
                wait_running([holder], 1)
                answer = request(other.port, "DELETE", "/v1/requests/across-1")
                assert (answer[0], json.loads(answer[2])) == (
                    200,
                    {"id": "across-1", "cancelled": True},
                )
                assert pending.getresponse().status == 499
            assert wait_idle(holder)["requests_aborted_total"] == aborted + 1
            assert request(other.port, "DELETE", "/v1/requests/nobody")[0] == 404
