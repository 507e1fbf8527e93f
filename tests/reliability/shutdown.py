"""Stop a real server with SIGTERM or SIGINT while requests are in flight; see what happened.

    .venv/bin/python -m tests.reliability.shutdown --runs 3      # the medians in the docs

In flight when the signal is sent: a streaming response (read by the client), a request
sleeping in the app, one whose work runs in a worker thread, one queued behind a request
holding the app's only slot (and that holder), and a second request pipelined on the slow
request's keep-alive connection (queued in the server, never started). The server's events
file says what each request saw; the time from the signal to the process's exit is measured.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers.client import HOST, connect, drain
from tests.servers.events import Event
from tests.servers.runner import Server, ServerSpec, start_server

GRACEFUL = 1  # seconds, both servers' graceful timeout here
THREAD_SECONDS = 0.3  # a worker thread's work that ends within the graceful timeout
LONG_THREAD_SECONDS = 2.0  # and one that outlasts it
EXIT_TIMEOUT = 30.0  # "did not hang"
IN_FLIGHT = ("stream", "slow", "thread", "long-thread", "hold", "queued")
LOG_MARKERS = (
    "Task was destroyed but it is pending",
    "Task exception was never retrieved",
    "Traceback",
)


def _uvicorn(target: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", target, "--host", HOST, "--port", str(port),
        "--http", "httptools", "--no-access-log",
        "--timeout-graceful-shutdown", str(GRACEFUL),
    ]  # fmt: skip


def _hypercorn(target: str, port: int) -> list[str]:
    # The default: one worker process under a parent that takes the signals.
    return [
        sys.executable, "-m", "hypercorn", "-k", "asyncio", "-b", f"{HOST}:{port}",
        "--graceful-timeout", str(GRACEFUL), target,
    ]  # fmt: skip


UVICORN = ServerSpec("uvicorn", _uvicorn)
HYPERCORN = ServerSpec("hypercorn-asyncio", _hypercorn)
SERVERS = (UVICORN, HYPERCORN)
WITH = "reliability.inflight_app:app"
WITHOUT = "reliability.inflight_app:bare_app"


@dataclass
class ShutdownResult:
    server: str
    signal: str
    middleware: bool
    seconds: float  # signal -> process exit
    returncode: int
    events: dict[str, list[Event]]
    log: str
    markers: dict[str, int] = field(default_factory=dict)

    def kinds(self, name: str) -> list[str]:
        return [event["event"] for event in self.events[name]]

    def outcome(self, name: str) -> str | None:
        exits = [event["outcome"] for event in self.events[name] if event["event"] == "exit"]
        return exits[0] if exits else None


def _request(port: int, target: str, *, extra: str = "") -> socket.socket:
    sock = connect(port)
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {HOST}\r\n\r\n{extra}".encode())
    return sock


def put_in_flight(server: Server, tag: str) -> tuple[dict[str, str], list[socket.socket]]:
    """Start every in-flight request; return their ids and the client sockets."""
    ids = {name: f"{tag}-{name}" for name in (*IN_FLIGHT, "pipelined")}
    port = server.port
    socks = [_request(port, f"/stream?id={ids['stream']}")]
    pipelined = f"GET /hello?id={ids['pipelined']} HTTP/1.1\r\nHost: {HOST}\r\n\r\n"
    socks.append(_request(port, f"/slow?id={ids['slow']}", extra=pipelined))
    socks.append(_request(port, f"/hold?id={ids['hold']}"))
    server.events.wait_for(ids["hold"], "holding", timeout=10)
    socks.append(_request(port, f"/queued?id={ids['queued']}"))
    socks.append(_request(port, f"/thread?id={ids['thread']}&t={THREAD_SECONDS}"))
    socks.append(_request(port, f"/thread?id={ids['long-thread']}&t={LONG_THREAD_SECONDS}"))
    for name in ("stream", "slow", "queued"):
        server.events.wait_for(ids[name], "start", timeout=10)
    for name in ("thread", "long-thread"):
        server.events.wait_for(ids[name], "thread-start", timeout=10)
    socks[0].recv(4096)  # the stream is flowing
    return ids, socks


def shutdown_run(
    spec: ServerSpec, middleware: bool, sig: signal.Signals, workdir: Path, tag: str
) -> ShutdownResult:
    server = start_server(spec, WITH if middleware else WITHOUT, workdir)
    socks: list[socket.socket] = []
    try:
        ids, socks = put_in_flight(server, tag)
        sent_at = time.monotonic()
        os.kill(server.process.pid, sig)
        deadline = sent_at + EXIT_TIMEOUT
        while server.process.poll() is None and time.monotonic() < deadline:
            for sock in socks:  # a client that keeps reading its stream
                drain(sock)
            time.sleep(0.005)
        exited_at = time.monotonic()
        try:
            returncode = server.process.wait(0)
        except subprocess.TimeoutExpired:
            returncode = -999  # hung: server.stop() below kills it
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    log = server.log()
    return ShutdownResult(
        server=spec.name,
        signal=sig.name,
        middleware=middleware,
        seconds=exited_at - sent_at,
        returncode=returncode,
        events={name: server.events.of(rid) for name, rid in ids.items()},
        log=log,
        markers={marker: log.count(marker) for marker in LOG_MARKERS},
    )


def medians(
    runs: int, progress: Callable[[ShutdownResult], None] | None = None
) -> dict[tuple[str, str, bool], list[float]]:
    times: dict[tuple[str, str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SERVERS:
            for sig in (signal.SIGTERM, signal.SIGINT):
                for index in range(runs):
                    for middleware in (False, True):
                        workdir = Path(tmp) / f"{spec.name}-{sig.name}-{middleware}-{index}"
                        workdir.mkdir()
                        result = shutdown_run(spec, middleware, sig, workdir, f"r{index}")
                        key = (spec.name, sig.name, middleware)
                        times.setdefault(key, []).append(result.seconds)
                        if progress:
                            progress(result)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    def progress(result: ShutdownResult) -> None:
        print(  # noqa: T201
            f"{result.server} {result.signal} middleware={result.middleware}: "
            f"{result.seconds:.2f} s, exit {result.returncode}, log markers {result.markers}"
        )

    times = medians(args.runs, progress)
    print("| server | signal | without middleware | with middleware |")  # noqa: T201
    print("|---|---|---|---|")  # noqa: T201
    for spec in SERVERS:
        for sig in ("SIGTERM", "SIGINT"):
            without = statistics.median(times[spec.name, sig, False])
            with_ = statistics.median(times[spec.name, sig, True])
            print(f"| {spec.name} | {sig} | {without:.2f} s | {with_:.2f} s |")  # noqa: T201


if __name__ == "__main__":
    main()
