"""Across hops with a real engine: client -> gateway -> engine server, and nginx in front.

Every hop is its own process on 127.0.0.1: the backend is `python -m example_app serve` on the
simulated engine with one batch slot (so a second request waits in the queue), the gateways
are `python -m example_app gateway --backend URL` with the asgi-cancel binding (middleware +
`CancelTransport`) and without it (`--no-binding`, a plain httpx proxy). A raw-socket client
closes its connection mid-generation or while its request is queued. What is asserted is the
backend engine's own counters: with the binding it generates at most about one step after the
close; without it, the request is generated to the end for nobody. The close -> abort latency
(the first `/metrics` poll that shows the request gone, polling included) is printed
(`pytest -s`); docs/at-scale.md quotes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from example_app.gateway_cli import GatewayProcess
from example_app.launch import ServerProcess, Subprocess, answers, free_port

from .helpers import (
    close,
    completion_body,
    delta,
    open_request,
    read_until,
    request,
    stats,
    wait_for,
    wait_idle,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

MAX_TOKENS = 30  # the leaving request: 1.5 s at 50 ms steps if nobody stops it
BLOCKER_TOKENS = 16  # holds the backend's only batch slot for 0.8 s
AFTER_CLOSE = 2  # tokens after the close: the step racing the close, the one racing the abort
BOUND, PLAIN = "gateway (binding)", "gateway (no binding)"
CASES = {
    "non-streaming": (False, False),
    "streaming": (True, False),
    "non-streaming-queued": (False, True),
    "streaming-queued": (True, True),
}


def post(port: int, stream: bool, max_tokens: int) -> socket.socket:
    """A raw connection with one completion request on it, so that closing it disconnects."""
    return open_request(port, "/v1/completions", completion_body(max_tokens, stream=stream))


@dataclass
class Outcome:
    generated_after_close: float  # tokens, until the engine was idle again
    wasted: float  # tokens the backend counted after it saw its own client leave
    aborted: float


def leave(engine: ServerProcess, via: str, port: int, case: str, *, expect_abort: bool) -> Outcome:
    """Send a request to `port`, close it mid-generation or while it waits in the backend's
    queue, and follow the backend until it is idle again."""
    stream, queued = CASES[case]
    before = wait_idle(engine)
    blocker = None
    if queued:  # straight to the backend
        blocker = post(engine.port, False, BLOCKER_TOKENS)
        wait_for(engine, "running the blocker", lambda s: s["requests_running"] == 1)
    with post(port, stream, MAX_TOKENS) as sock:
        if queued:
            wait_for(engine, "queueing", lambda s: s["requests_waiting"] == 1)
        elif stream:
            read_until(sock, lambda received: received.count(b'"text":" ') >= 2)  # 2 tokens
        else:
            generated = before["tokens_generated_total"] + 2
            wait_for(engine, "generating", lambda s: s["tokens_generated_total"] >= generated)
        at_close = stats(engine)["tokens_generated_total"]
        closed_at = close(sock)
    latency = "never"
    if expect_abort:
        gone = "requests_waiting" if queued else "requests_running"
        # Dequeued while the blocker still runs: aborted from the queue, not generated.
        sample = wait_for(engine, "aborted", lambda s: s[gone] == 0)
        latency = f"{(time.monotonic() - closed_at) * 1e3:.1f} ms"
        assert sample["requests_running"] == int(queued)
    if blocker is not None:
        with blocker:
            assert read_until(blocker, lambda received: b"\r\n" in received).startswith(
                b"HTTP/1.1 200 "
            )
    after = wait_idle(engine)
    generated_after = after["tokens_generated_total"] - at_close
    if queued:  # the blocker's remaining tokens are not the leaving request's
        generated_after = delta(after, before, "tokens_generated") - BLOCKER_TOKENS
    outcome = Outcome(
        generated_after,
        delta(after, before, "tokens_wasted"),
        delta(after, before, "requests_aborted"),
    )
    sys.stdout.write(
        f"\n{via} {case}: client close -> backend abort {latency}; "
        f"{outcome.generated_after_close:.0f} tokens after the close\n"
    )
    return outcome


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    args = ["--step-time", "0.05", "--max-batch-size", "1", "--log-level", "warning"]
    with ServerProcess(*args, server="uvicorn") as process:
        yield process


@pytest.fixture(scope="module")
def gateway(engine: ServerProcess) -> Iterator[GatewayProcess]:
    with GatewayProcess([engine.base_url]) as process:
        yield process


@pytest.fixture(scope="module")
def plain_gateway(engine: ServerProcess) -> Iterator[GatewayProcess]:
    with GatewayProcess([engine.base_url], "--no-binding") as process:
        yield process


def assert_stops(engine: ServerProcess, via: str, port: int, case: str) -> None:
    """The backend aborts at once: at most a step after the close, none for a queued one."""
    outcome = leave(engine, via, port, case, expect_abort=True)
    assert outcome.aborted == 1
    assert outcome.wasted <= 1
    assert outcome.generated_after_close <= (0 if CASES[case][1] else AFTER_CLOSE)


@pytest.mark.parametrize("case", CASES)
def test_the_backend_stops_when_the_client_leaves_the_gateway(
    engine: ServerProcess, gateway: GatewayProcess, case: str
) -> None:
    assert_stops(engine, BOUND, gateway.port, case)
    assert "Traceback" not in gateway.log_text()


@pytest.mark.parametrize("case", ["non-streaming", "non-streaming-queued", "streaming-queued"])
def test_without_the_binding_the_backend_generates_for_nobody(
    engine: ServerProcess, plain_gateway: GatewayProcess, case: str
) -> None:
    outcome = leave(engine, PLAIN, plain_gateway.port, case, expect_abort=False)
    if CASES[case][0]:
        # Queued behind the blocker for nobody; once its headers reach the gateway,
        # Starlette's own stream listener (ASGI spec 2.3 on uvicorn) closes it.
        assert outcome.generated_after_close >= 1
    else:
        assert outcome.aborted == 0
        assert outcome.generated_after_close >= MAX_TOKENS - 2  # to the end
        assert outcome.wasted == 0  # and the backend cannot tell: its client never left


def test_without_the_binding_a_started_stream_is_closed_by_starlette_itself(
    engine: ServerProcess, plain_gateway: GatewayProcess
) -> None:
    # The control that does not fail: Starlette's StreamingResponse listens for the disconnect
    # once the response has started (below ASGI spec 2.4), and closing the upstream httpx
    # response closes the backend connection.
    outcome = leave(engine, PLAIN, plain_gateway.port, "streaming", expect_abort=True)
    assert outcome.aborted == 1


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
        listen 127.0.0.1:{ignoring};
        location / {{ proxy_pass http://127.0.0.1:{gateway}; proxy_ignore_client_abort on; }}
    }}
    server {{
        listen 127.0.0.1:{direct};
        location / {{ proxy_pass http://127.0.0.1:{backend}; }}
    }}
}}
"""


@dataclass
class Nginx:
    port: int  # default settings, to the gateway
    ignoring: int  # proxy_ignore_client_abort on, to the gateway
    direct: int  # default settings, straight to the backend


@pytest.fixture(scope="module")
def nginx(
    engine: ServerProcess, gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nginx]:
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("nginx is not installed, and CI=true: .ci/run installs it")
        pytest.skip("nginx is not installed (apt-get install nginx)")
    prefix = tmp_path_factory.mktemp("nginx")
    ports = {"ignoring": 0, "direct": 0}

    def argv(port: int) -> list[str]:
        ports.update(ignoring=free_port(), direct=free_port())
        conf = NGINX_CONF.format(
            # As root, nginx's workers would run as nobody, who cannot write the temp paths.
            user="user root;" if os.geteuid() == 0 else "",
            prefix=prefix,
            port=port,
            gateway=gateway.port,
            backend=engine.port,
            **ports,
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
        for port in ports.values():
            assert request(port, "GET", "/health")[0] == 200, f"nginx not listening on {port}"
        yield Nginx(process.port, **ports)


@pytest.mark.parametrize("case", CASES)
def test_nginx_defaults_pass_the_close_on(engine: ServerProcess, nginx: Nginx, case: str) -> None:
    assert_stops(engine, "nginx (defaults) -> gateway", nginx.port, case)


def test_nginx_defaults_straight_to_the_backend(engine: ServerProcess, nginx: Nginx) -> None:
    assert_stops(engine, "nginx (defaults) -> backend", nginx.direct, "non-streaming")


def test_nginx_ignoring_client_aborts_hides_the_close(engine: ServerProcess, nginx: Nginx) -> None:
    via = "nginx (ignoring aborts) -> gateway"
    outcome = leave(engine, via, nginx.ignoring, "non-streaming", expect_abort=False)
    assert outcome.aborted == 0
    assert outcome.generated_after_close >= MAX_TOKENS - 2
