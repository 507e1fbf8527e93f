"""What the demo's tests share: the model name, the engine's counters, raw HTTP, the CLI."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from example_app import metrics
from example_app.launch import HOST, PACKAGE_ROOT, Subprocess, example_app_env

MODEL = "sim-llm"
SERVERS = ("hypercorn", "uvicorn")
WATCHDOG = 10.0


def stats(server: Subprocess) -> dict[str, float]:
    """The engine's counters from `/metrics`, without their `example_engine_` prefix."""
    status, _, body = request(server.port, "GET", "/metrics")
    assert status == 200, body
    parsed = metrics.parse(body.decode())
    return {name.removeprefix("example_engine_"): value for name, value in parsed.items()}


def wait_for(
    server: Subprocess, what: str, check: Callable[[dict[str, float]], bool]
) -> dict[str, float]:
    """Poll `/metrics` until `check` holds: a watchdog for a state change, not a measurement."""
    deadline = time.monotonic() + WATCHDOG
    while not check(sample := stats(server)):
        assert time.monotonic() < deadline, f"still not {what} after {WATCHDOG} s: {sample}"
        time.sleep(0.005)
    return sample


def wait_idle(server: Subprocess) -> dict[str, float]:
    return wait_for(server, "idle", lambda s: s["requests_running"] + s["requests_waiting"] == 0)


def delta(after: dict[str, float], before: dict[str, float], counter: str) -> float:
    return after[f"{counter}_total"] - before[f"{counter}_total"]


def completion_body(max_tokens: int, **fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, **fields}).encode()


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """Status, headers and body of one request (http.client: no proxy from the environment)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=WATCHDOG)
    try:
        connection.request(method, path, body=body, headers=dict(headers or {}))
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def open_request(
    port: int, path: str, body: bytes, headers: Mapping[str, str] | None = None
) -> socket.socket:
    """A raw connection with one POST on it, so that closing it disconnects."""
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    sock = socket.create_connection((HOST, port), timeout=WATCHDOG)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    received = b""
    while not done(received):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {received!r}"
        received += chunk
    return received


def close(sock: socket.socket) -> float:
    """The client leaves: FIN first (a close() with unread bytes sends only an RST)."""
    closed_at = time.monotonic()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    return closed_at


def run_example(
    *args: str, timeout: float = 60.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m example_app ARGS` to the end, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "example_app", *args],
        cwd=PACKAGE_ROOT,
        env={**os.environ, **example_app_env(env)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
