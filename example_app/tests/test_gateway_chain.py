"""Across hops with a real engine: client -> gateway -> example_app engine server, and the same
chain behind a real nginx.

Every hop is its own process on 127.0.0.1: the backend is `python -m example_app serve` on the
simulated engine with one batch slot (so a second request waits in the queue), the gateways are
`python -m example_app gateway --backend URL`, with the asgi-cancel binding (middleware +
`CancelTransport`) and without it (`--no-binding`, a plain httpx proxy). The client is a raw
socket that closes its connection mid-generation or while its request is queued. What is
asserted is the backend engine's own counters (`/metrics`): with the binding its running and
waiting requests drop to 0 and it generates at most about one step after the client's close;
without it, the same request is generated to the end for nobody. The close -> abort latency
(the first `/metrics` poll that shows the request gone, so a few ms of polling included) is
printed (`pytest -s`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from example_app import metrics
from example_app.gateway_cli import GatewayProcess
from example_app.launch import ServerProcess, Subprocess, answers, free_port, http_get

from tests.servers.client import FIN, close, connect, read_head, read_response, recv_some

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

STEP = 0.05  # seconds per engine step: "one step" of waste is one token per request
MAX_TOKENS = 30  # the leaving request: 1.5 s of generation if nobody stops it
BLOCKER_TOKENS = 16  # holds the backend's only batch slot for 0.8 s
WATCHDOG = 15.0
# Tokens the backend may generate for a request after its client closed: the step racing the
# close, and the one racing the abort.
AFTER_CLOSE = 2
MODEL = "sim-llm"


@dataclass
class Engine:
    """The backend's engine as its `/metrics` shows it."""

    process: ServerProcess

    def stats(self) -> dict[str, float]:
        status, body = http_get(self.process.port, "/metrics", timeout=WATCHDOG)
        assert status == 200
        return metrics.parse(body.decode())

    def value(self, name: str) -> float:
        return self.stats()[f"example_engine_{name}"]

    def wait(self, what: str, check: Callable[[dict[str, float]], bool]) -> float:
        """Poll until `check(stats)`; return `time.monotonic()` of the poll that saw it."""
        deadline = time.monotonic() + WATCHDOG
        while True:
            sample = self.stats()
            seen = time.monotonic()
            if check(sample):
                return seen
            if seen > deadline:
                raise AssertionError(f"backend still not {what} after {WATCHDOG} s: {sample}")
            time.sleep(0.002)

    def wait_idle(self) -> dict[str, float]:
        self.wait("idle", lambda s: _busy(s) == 0)
        return self.stats()


def _busy(sample: dict[str, float]) -> float:
    return sample["example_engine_requests_running"] + sample["example_engine_requests_waiting"]


def _generated(sample: dict[str, float]) -> float:
    return sample["example_engine_tokens_generated_total"]


def _completion_body(stream: bool, max_tokens: int) -> bytes:
    if stream:
        messages = [{"role": "user", "content": "hello"}]
        request = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
    else:
        request = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}
    return json.dumps(request).encode()


def post(port: int, stream: bool, max_tokens: int, request_id: str | None = None) -> socket.socket:
    """Open a connection and send an OpenAI completion request (chat when streaming)."""
    path = "/v1/chat/completions" if stream else "/v1/completions"
    body = _completion_body(stream, max_tokens)
    headers = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    headers.append(f"Content-Length: {len(body)}")
    if request_id is not None:
        headers.append(f"X-Request-Id: {request_id}")
    sock = connect(port, timeout=WATCHDOG)
    sock.sendall(("\r\n".join(headers) + "\r\n\r\n").encode() + body)
    return sock


def read_tokens(sock: socket.socket, count: int) -> None:
    """Read a stream until `count` content events arrived (the stream reached the client)."""
    _, _, data = read_head(sock)
    while data.count(b'"delta":{"content"') < count:
        data += recv_some(sock)


@dataclass
class Outcome:
    closed_at: float
    gone_at: float | None  # the backend no longer had the request (None: it ran on)
    generated_after_close: float  # tokens, until the engine was idle again
    wasted: float  # tokens the backend counted after it saw its own client leave
    aborted: float

    @property
    def latency_ms(self) -> float:
        assert self.gone_at is not None
        return (self.gone_at - self.closed_at) * 1e3


def leave(
    engine: Engine, port: int, *, stream: bool, queued: bool, expect_abort: bool, label: str
) -> Outcome:
    """Send a request to `port`, close the connection mid-generation or while it waits in the
    backend's queue, and follow the backend until it is idle again."""
    before = engine.wait_idle()
    blocker = None
    if queued:
        blocker = post(engine.process.port, False, BLOCKER_TOKENS)  # straight to the backend
        engine.wait("running the blocker", lambda s: s["example_engine_requests_running"] == 1)
    sock = post(port, stream, MAX_TOKENS)
    try:
        if queued:
            engine.wait("queueing", lambda s: s["example_engine_requests_waiting"] == 1)
        elif stream:
            read_tokens(sock, 2)
        else:
            engine.wait("generating", lambda s: _generated(s) >= _generated(before) + 2)
        at_close = _generated(engine.stats())
    finally:
        closed_at = close(sock, FIN)
    gone_at = None
    if expect_abort:
        waiting = "example_engine_requests_waiting"
        if queued:
            gone_at = engine.wait("dequeued", lambda s: s[waiting] == 0)
            # Dequeued while the blocker still runs: aborted from the queue, not generated.
            assert engine.value("requests_running") == 1
        else:
            gone_at = engine.wait("aborted", lambda s: _busy(s) == 0)
    if blocker is not None:
        with blocker:
            assert read_response(blocker).status == 200
    after = engine.wait_idle()
    generated_after = _generated(after) - at_close
    if queued:  # the blocker's remaining tokens are not the leaving request's
        generated_after = _generated(after) - _generated(before) - BLOCKER_TOKENS
    outcome = Outcome(
        closed_at,
        gone_at,
        generated_after,
        after["example_engine_tokens_wasted_total"] - before["example_engine_tokens_wasted_total"],
        after["example_engine_requests_aborted_total"]
        - before["example_engine_requests_aborted_total"],
    )
    result = f"{outcome.latency_ms:.1f} ms" if gone_at is not None else "never"
    sys.stdout.write(
        f"\n{label}: client close -> backend abort {result}; "
        f"{outcome.generated_after_close:.0f} tokens after the close, "
        f"{outcome.wasted:.0f} counted wasted by the backend\n"
    )
    return outcome


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    args = ["--step-time", str(STEP), "--max-batch-size", "1", "--log-level", "warning"]
    with ServerProcess(*args, "--cancel-endpoint", server="uvicorn") as process:
        yield Engine(process)


@pytest.fixture(scope="module")
def gateway(engine: Engine) -> Iterator[GatewayProcess]:
    with GatewayProcess([engine.process.base_url]) as process:
        yield process


@pytest.fixture(scope="module")
def plain_gateway(engine: Engine) -> Iterator[GatewayProcess]:
    with GatewayProcess([engine.process.base_url], "--no-binding") as process:
        yield process


CASES = [(False, False), (True, False), (False, True), (True, True)]
CASE_IDS = ["non-streaming", "streaming", "non-streaming-queued", "streaming-queued"]


@pytest.mark.parametrize(("stream", "queued"), CASES, ids=CASE_IDS)
def test_the_backend_stops_when_the_client_leaves_the_gateway(
    engine: Engine, gateway: GatewayProcess, stream: bool, queued: bool
) -> None:
    label = f"gateway (binding) {CASE_IDS[CASES.index((stream, queued))]}"
    outcome = leave(
        engine, gateway.port, stream=stream, queued=queued, expect_abort=True, label=label
    )
    assert outcome.aborted == 1
    assert outcome.wasted <= 1
    if queued:
        assert outcome.generated_after_close == 0  # never got a batch slot
    else:
        assert outcome.generated_after_close <= AFTER_CLOSE
    assert "Traceback" not in gateway.log_text()


@pytest.mark.parametrize(
    ("stream", "queued"),
    [(False, False), (False, True), (True, True)],
    ids=["non-streaming", "non-streaming-queued", "streaming-queued"],
)
def test_without_the_binding_the_backend_generates_for_nobody(
    engine: Engine, plain_gateway: GatewayProcess, stream: bool, queued: bool
) -> None:
    label = f"gateway (no binding) {'streaming' if stream else 'non-streaming'}"
    label += "-queued" if queued else ""
    outcome = leave(
        engine, plain_gateway.port, stream=stream, queued=queued, expect_abort=False, label=label
    )
    if stream:
        # Queued behind the blocker for nobody; once its headers reach the gateway,
        # Starlette's own stream listener (ASGI spec 2.3 on uvicorn) closes it.
        assert outcome.generated_after_close >= 1
    else:
        assert outcome.aborted == 0
        assert outcome.generated_after_close >= MAX_TOKENS - 2  # to the end
        # And the backend cannot even tell: its client, the gateway, never left.
        assert outcome.wasted == 0


def test_without_the_binding_a_started_stream_is_closed_by_starlette_itself(
    engine: Engine, plain_gateway: GatewayProcess
) -> None:
    # The control that does not fail: Starlette's StreamingResponse listens for the disconnect
    # once the response has started (servers below ASGI spec 2.4), and closing the upstream
    # httpx response closes the backend connection.
    label = "gateway (no binding) streaming"
    outcome = leave(
        engine, plain_gateway.port, stream=True, queued=False, expect_abort=True, label=label
    )
    assert outcome.aborted == 1


def test_a_request_is_cancelled_by_id_through_the_gateway(
    engine: Engine, gateway: GatewayProcess
) -> None:
    """The client's X-Request-Id reaches the backend, whose cancel endpoint stops it (499)."""
    engine.wait_idle()
    request_id = f"chain-{os.getpid()}-{time.monotonic_ns()}"
    with post(gateway.port, False, MAX_TOKENS, request_id=request_id) as sock:
        engine.wait("running", lambda s: s["example_engine_requests_running"] == 1)
        status, body = _delete(engine.process.port, f"/v1/requests/{request_id}")
        assert (status, body["cancelled"]) == (202, True)
        assert read_response(sock).status == 499  # the backend's 499, passed on
    after = engine.wait_idle()
    assert after["example_engine_requests_running"] == 0
    unknown = _delete(engine.process.port, "/v1/requests/no-such-request")
    assert unknown == (404, {"id": "no-such-request", "cancelled": False})


def _delete(port: int, path: str) -> tuple[int, dict[str, object]]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WATCHDOG)
    try:
        connection.request("DELETE", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


# nginx in front --------------------------------------------------------------------------------

NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    # Default proxy settings: proxy_ignore_client_abort off, proxy_buffering on,
    # proxy_request_buffering on, proxy_http_version 1.0.
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://127.0.0.1:{gateway}; }}
    }}
    server {{
        listen 127.0.0.1:{ignoring_port};
        location / {{
            proxy_pass http://127.0.0.1:{gateway};
            proxy_ignore_client_abort on;
        }}
    }}
    server {{
        listen 127.0.0.1:{direct_port};
        location / {{ proxy_pass http://127.0.0.1:{backend}; }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


@dataclass
class Nginx:
    process: Subprocess
    ignoring_port: int  # proxy_ignore_client_abort on
    direct_port: int  # straight to the backend, no gateway

    @property
    def port(self) -> int:  # defaults, to the gateway
        return self.process.port


@pytest.fixture(scope="module")
def nginx(
    engine: Engine, gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nginx]:
    binary = nginx_binary()
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("nginx is not installed, and CI=true: .ci/run installs it")
        pytest.skip("nginx is not installed (apt-get install nginx)")
    prefix = tmp_path_factory.mktemp("nginx")
    extra = {"ignoring_port": 0, "direct_port": 0}

    def argv(port: int) -> list[str]:
        extra["ignoring_port"], extra["direct_port"] = free_port(), free_port()
        conf = NGINX_CONF.format(
            # As root, nginx's workers would run as nobody, who cannot write the temp paths.
            user="user root;" if os.geteuid() == 0 else "",
            prefix=prefix,
            port=port,
            gateway=gateway.port,
            backend=engine.process.port,
            **extra,
        )
        (prefix / "nginx.conf").write_text(conf)
        return [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]

    process = Subprocess(
        argv,
        ready=answers("/health"),
        cwd=Path(prefix),
        log=prefix / "nginx.out",
        retry_not_ready=True,
        stop_signal=signal.SIGQUIT,  # graceful: workers finish, the master removes its pid
    )
    with process:
        for extra_port in extra.values():
            assert answers("/health")(extra_port), f"nginx not listening on {extra_port}"
        yield Nginx(process, extra["ignoring_port"], extra["direct_port"])


@pytest.mark.parametrize(("stream", "queued"), CASES, ids=CASE_IDS)
def test_nginx_defaults_pass_the_close_on(
    engine: Engine, nginx: Nginx, stream: bool, queued: bool
) -> None:
    label = f"nginx (defaults) -> gateway (binding) {CASE_IDS[CASES.index((stream, queued))]}"
    outcome = leave(
        engine, nginx.port, stream=stream, queued=queued, expect_abort=True, label=label
    )
    assert outcome.aborted == 1
    if queued:
        assert outcome.generated_after_close == 0
    else:
        assert outcome.generated_after_close <= AFTER_CLOSE


def test_nginx_defaults_straight_to_the_backend(engine: Engine, nginx: Nginx) -> None:
    label = "nginx (defaults) -> backend non-streaming"
    outcome = leave(
        engine, nginx.direct_port, stream=False, queued=False, expect_abort=True, label=label
    )
    assert outcome.aborted == 1
    assert outcome.generated_after_close <= AFTER_CLOSE


def test_nginx_ignoring_client_aborts_hides_the_close(engine: Engine, nginx: Nginx) -> None:
    label = "nginx (proxy_ignore_client_abort on) -> gateway (binding) non-streaming"
    outcome = leave(
        engine, nginx.ignoring_port, stream=False, queued=False, expect_abort=False, label=label
    )
    assert outcome.aborted == 0
    assert outcome.generated_after_close >= MAX_TOKENS - 2
