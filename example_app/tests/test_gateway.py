"""`python -m example_app gateway` and the example server's cancel-by-id endpoint, as real
processes on 127.0.0.1 (the cancel-across-hops measurements are in
test_gateway_chain.py)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from example_app.gateway_cli import GatewayProcess
from example_app.launch import PACKAGE_ROOT, ServerProcess, free_port, http_get

from .conftest import MODEL

pytestmark = pytest.mark.timeout(90)

WATCHDOG = 10.0
SECRET = "s3cret"


def request(
    port: int, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WATCHDOG)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def engine_stats(process: ServerProcess) -> dict[str, float]:
    return {
        name.removeprefix("example_engine_"): value for name, value in process.metrics().items()
    }


def wait_for(process: ServerProcess, what: str, name: str, value: float) -> None:
    deadline = time.monotonic() + WATCHDOG
    while engine_stats(process)[name] != value:
        assert time.monotonic() < deadline, f"{what}: {name} never became {value}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def backends() -> Iterator[list[ServerProcess]]:
    args = ("--step-time", "0.01", "--log-level", "warning", "--cancel-endpoint")
    with ServerProcess(*args, "--cancel-secret", SECRET) as first, ServerProcess(*args) as second:
        yield [first, second]


@pytest.fixture(scope="module")
def gateway(backends: list[ServerProcess]) -> Iterator[GatewayProcess]:
    urls = [backend.base_url for backend in backends]
    with GatewayProcess(urls, "--cancel-endpoint", "--cancel-secret", SECRET) as process:
        yield process


def send_completion(port: int, request_id: str, max_tokens: int) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WATCHDOG)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens})
    headers = {"content-type": "application/json", "x-request-id": request_id}
    connection.request("POST", "/v1/completions", body=body, headers=headers)
    return connection


def test_the_cancel_endpoint_needs_the_secret_and_stops_the_request(
    backends: list[ServerProcess],
) -> None:
    backend = backends[0]
    aborted = engine_stats(backend)["requests_aborted_total"]
    connection = send_completion(backend.port, "by-id-1", 1000)  # 10 s if nobody stops it
    try:
        wait_for(backend, "started", "requests_running", 1)
        assert request(backend.port, "DELETE", "/v1/requests/by-id-1")[0] == 403
        wrong = {"x-cancel-secret": "nope"}
        assert request(backend.port, "DELETE", "/v1/requests/by-id-1", wrong)[0] == 403
        right = {"x-cancel-secret": SECRET}
        answer = request(backend.port, "DELETE", "/v1/requests/by-id-1", right)
        assert answer == (202, {"id": "by-id-1", "cancelled": True})
        assert connection.getresponse().status == 499
    finally:
        connection.close()
    wait_for(backend, "aborted", "requests_running", 0)
    assert engine_stats(backend)["requests_aborted_total"] == aborted + 1
    again = request(backend.port, "DELETE", "/v1/requests/by-id-1", right)
    assert again == (404, {"id": "by-id-1", "cancelled": False})


def test_the_cancel_endpoint_is_off_by_default() -> None:
    with ServerProcess("--log-level", "warning") as backend:
        status, body = request(backend.port, "DELETE", "/v1/requests/x")
        assert status == 404
        assert "error" in body


def test_the_gateway_balances_and_sums_the_backends_metrics(
    gateway: GatewayProcess, backends: list[ServerProcess]
) -> None:
    before = [engine_stats(backend)["requests_total"] for backend in backends]
    with openai.OpenAI(
        base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0, timeout=WATCHDOG
    ) as client:
        for _ in range(4):  # one at a time: round-robin among equally loaded backends
            completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 3
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert sum(bool(chunk.choices and chunk.choices[0].delta.content) for chunk in chunks) == 3
    after = [engine_stats(backend)["requests_total"] for backend in backends]
    served = [b - a for a, b in zip(before, after, strict=True)]
    assert sorted(served) == [2, 3]
    status, body = http_get(gateway.port, "/metrics")
    assert status == 200
    summed = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in body.decode().splitlines()
        if line and not line.startswith("#")
    }
    totals = sum(engine_stats(backend)["requests_total"] for backend in backends)
    assert summed["example_engine_requests_total"] == totals


def test_the_gateway_cancels_by_id_and_the_backend_aborts(
    gateway: GatewayProcess, backends: list[ServerProcess]
) -> None:
    aborted = sum(engine_stats(backend)["requests_aborted_total"] for backend in backends)
    connection = send_completion(gateway.port, "by-id-2", 1000)
    try:
        deadline = time.monotonic() + WATCHDOG
        while sum(engine_stats(backend)["requests_running"] for backend in backends) != 1:
            assert time.monotonic() < deadline, "never started"
            time.sleep(0.01)
        headers = {"x-cancel-secret": SECRET}
        answer = request(gateway.port, "DELETE", "/v1/requests/by-id-2", headers)
        assert answer == (202, {"id": "by-id-2", "cancelled": True})
        assert connection.getresponse().status == 499  # the gateway's own answer
    finally:
        connection.close()
    for backend in backends:
        wait_for(backend, "aborted", "requests_running", 0)
    after = sum(engine_stats(backend)["requests_aborted_total"] for backend in backends)
    assert after == aborted + 1


def test_an_unreachable_backend_is_a_502() -> None:
    with GatewayProcess([f"http://127.0.0.1:{free_port()}"]) as gateway:
        with openai.OpenAI(
            base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0, timeout=WATCHDOG
        ) as client:
            with pytest.raises(openai.InternalServerError) as caught:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert caught.value.status_code == 502
        assert "Traceback" not in gateway.log_text()


def test_the_cancel_endpoint_needs_the_binding() -> None:
    command = [sys.executable, "-m", "example_app", "gateway", "--no-binding", "--cancel-endpoint"]
    done = subprocess.run(
        command, cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=WATCHDOG, check=False
    )
    assert done.returncode == 1
    assert "--cancel-endpoint needs the binding" in done.stderr


def test_the_demo_through_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "demo.png"
    command = [sys.executable, "-m", "example_app", "demo", "--gateway", "--quick"]
    done = subprocess.run(
        [*command, "--clients", "8", "--out", str(out)],
        cwd=PACKAGE_ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    table = out.with_suffix(".txt").read_text()
    assert "backend 1 (:" in table
    assert "backend 2 (:" in table
    aborted = [line for line in table.splitlines() if "engine requests aborted" in line]
    assert len(aborted) == 2
    # The bound pass aborted the requests of clients that left (on one backend or the other).
    assert sum(int(line.split()[-2].replace(",", "")) for line in aborted) >= 1
    # Per backend, the tokens nobody read (the gateway names each response's backend) add up
    # to the all-backends figure, plus the warm-up's two one-token requests.
    unread = [line.split() for line in table.splitlines() if "tokens nobody read" in line]
    per_backend = [words for words in unread if words[0] == "tokens"]
    (everyone,) = [words for words in unread if words[0] == "all"]
    assert len(per_backend) == 2
    for column in (-2, -1):
        total = sum(int(words[column].replace(",", "")) for words in per_backend)
        assert 0 <= total - int(everyone[column].replace(",", "")) <= 2
