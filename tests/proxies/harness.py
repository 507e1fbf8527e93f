"""Run a proxy in front of an app server, leave a request through it, and see what the app saw.

`leave(port, events, scenario)` opens a raw connection to the proxy, sends the scenario's request,
waits until the app works on it, closes the connection (FIN), and waits a bounded time
(`NEVER_AFTER`) for the app's cancellation. The outcome is one of `CANCELLED` (with the latency
from the close to the app's `CancelledError`, one monotonic clock), `NEVER` (the app went on
working for nobody) or `NOT_STARTED` (the proxy never handed the request to the app: there was
nothing to cancel). `ASGI_CANCEL_PROXY_LOG=path` appends every outcome to `path` as a JSON line;
`python -m tests.proxies.table` turns those into the table in docs/proxies.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ..servers.client import FIN, close, connect, new_id, send_request
from ..servers.events import EventLog
from ..servers.process import free_port
from ..servers.runner import Server, ServerSpec, running_server
from .proxies import Ports, Proxy

PROXY_LOG_ENV = "ASGI_CANCEL_PROXY_LOG"
NEVER_AFTER = 3.0  # seconds after the close: no cancellation by then is "never"
WATCHDOG = 5.0  # for the app to start working on the request
UPLOAD_START = 1.0  # for a proxy to pass an upload's first bytes on; else it buffers the body
SEEN_WITHIN = 0.5  # for the first piece of an answer to reach the client through the proxy
UPLOAD_SIZE = 1_000_000
UPLOAD_SENT = 20_000

CANCELLED, NEVER, NOT_STARTED = "cancelled", "never", "not started"
FIRST_BYTE, SSE, BODY, UPLOAD = "first-byte", "sse", "body", "upload"
SCENARIOS = (FIRST_BYTE, SSE, BODY, UPLOAD)
DEFAULTS, TUNED = "defaults", "tuned"
CONFIGS = (DEFAULTS, TUNED)


@dataclass(frozen=True)
class Outcome:
    proxy: str
    version: str
    server: str
    config: str
    scenario: str
    outcome: str
    ms: float | None  # close -> the app's CancelledError; None unless cancelled
    seen: bool | None  # a piece of the answer reached the client before it left (sse, body)


@dataclass
class RunningProxy:
    proxy: Proxy
    version: str
    backend: Server
    ports: Ports

    def port(self, config: str) -> int:
        return self.ports.defaults if config == DEFAULTS else self.ports.tuned


@contextmanager
def running_proxy(proxy: Proxy, backend: Server, workdir: Path) -> Iterator[RunningProxy]:
    """`proxy` in front of `backend`, its config written to `workdir`, until the block exits.
    Ready once `GET /hello` through its `defaults` port returns the app's hello."""
    chosen: list[Ports] = []

    def argv(target: str, port: int) -> list[str]:
        ports = Ports(port, free_port(), backend.port)
        chosen.append(ports)
        return proxy.command(workdir, ports)

    spec = ServerSpec(proxy.name, argv)
    with running_server(spec, "", workdir):
        yield RunningProxy(proxy, proxy.version(), backend, chosen[-1])


def leave(port: int, events: EventLog, scenario: str) -> tuple[str, float | None, bool | None]:
    """Leave one request of `scenario` through `port`; return (outcome, latency ms, seen)."""
    rid = new_id()
    seen: bool | None = None
    with connect(port) as sock:
        if scenario == UPLOAD:
            headers = (("Content-Length", str(UPLOAD_SIZE)),)
            send_request(
                sock, "POST", f"/upload?id={rid}", headers=headers, body=b"x" * UPLOAD_SENT
            )
            deadline = time.monotonic() + UPLOAD_START
            while not events.of(rid, "received") and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            path = {FIRST_BYTE: "/slow", SSE: "/sse", BODY: "/body"}[scenario]
            send_request(sock, "GET", f"{path}?id={rid}")
            started = "start" if scenario == FIRST_BYTE else "streaming"
            events.wait_for(rid, started, timeout=WATCHDOG)
            if scenario != FIRST_BYTE:
                seen = _body_seen(sock)
        closed_at = close(sock, FIN)
    deadline = closed_at + NEVER_AFTER
    while time.monotonic() < deadline:
        cancelled = events.of(rid, "cancelled")
        if cancelled:
            return CANCELLED, round((cancelled[0]["t"] - closed_at) * 1e3, 2), seen
        time.sleep(0.005)
    return (NEVER if events.of(rid) else NOT_STARTED), None, seen


def _body_seen(sock: socket.socket) -> bool:
    """Whether a piece of the body reaches the client within SEEN_WITHIN (the proxy streams)."""
    received = b""
    deadline = time.monotonic() + SEEN_WITHIN
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        received += data
        body = received.partition(b"\r\n\r\n")[2]
        if body and (b"data: token" in body or b"xxxx" in body):
            return True
    return False


def measure(running: RunningProxy, config: str, scenario: str) -> Outcome:
    """One cell: leave a request and keep the outcome (and log it, with PROXY_LOG_ENV set)."""
    left = leave(running.port(config), running.backend.events, scenario)
    proxy, server = running.proxy.name, running.backend.spec.name
    result = Outcome(proxy, running.version, server, config, scenario, *left)
    path = os.environ.get(PROXY_LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write(json.dumps(asdict(result)) + "\n")
    return result
