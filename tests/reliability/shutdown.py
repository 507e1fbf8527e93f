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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers.client import connect, drain, send_request
from tests.servers.events import Event
from tests.servers.runner import HYPERCORN_ARGS, UVICORN_ARGS, Server, ServerSpec, command

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


UVICORN = ServerSpec(
    "uvicorn",
    command(*UVICORN_ARGS, "--http", "httptools", "--timeout-graceful-shutdown", str(GRACEFUL)),
)
# The default: one worker process under a parent that takes the signals.
HYPERCORN = ServerSpec(
    "hypercorn-asyncio",
    command(*HYPERCORN_ARGS, "-k", "asyncio", "--graceful-timeout", str(GRACEFUL)),
)
SERVERS = (UVICORN, HYPERCORN)
CASES = [(spec, sig) for spec in SERVERS for sig in (signal.SIGTERM, signal.SIGINT)]
WITH = "tests.servers.apps:hookless_app"
WITHOUT = "tests.servers.apps:bare_app"


@dataclass
class ShutdownResult:
    server: str
    signal: str
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


def put_in_flight(server: Server, tag: str) -> tuple[dict[str, str], list[socket.socket]]:
    """Start every in-flight request; return their ids and the client sockets."""
    ids = {name: f"{tag}-{name}" for name in (*IN_FLIGHT, "pipelined")}
    socks: list[socket.socket] = []

    def send(*targets: str) -> None:  # several: pipelined on one connection
        socks.append(connect(server.port))
        for target in targets:
            send_request(socks[-1], "GET", target)

    send(f"/stream?id={ids['stream']}")
    send(f"/slow?id={ids['slow']}", f"/hello?id={ids['pipelined']}")
    send(f"/hold?id={ids['hold']}")
    server.events.wait_for(ids["hold"], "holding", timeout=10)
    send(f"/queued?id={ids['queued']}")
    send(f"/thread?id={ids['thread']}&t={THREAD_SECONDS}")
    send(f"/thread?id={ids['long-thread']}&t={LONG_THREAD_SECONDS}")
    for name in ("stream", "slow", "queued"):
        server.events.wait_for(ids[name], "start", timeout=10)
    for name in ("thread", "long-thread"):
        server.events.wait_for(ids[name], "thread-start", timeout=10)
    socks[0].recv(4096)  # the stream is flowing
    return ids, socks


def shutdown_run(
    spec: ServerSpec, middleware: bool, sig: signal.Signals, workdir: Path, tag: str
) -> ShutdownResult:
    server = Server(spec, WITH if middleware else WITHOUT, workdir)
    server.start()
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
        seconds=exited_at - sent_at,
        returncode=returncode,
        events={name: server.events.of(rid) for name, rid in ids.items()},
        log=log,
        markers={marker: log.count(marker) for marker in LOG_MARKERS},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    print("| server | signal | without middleware | with middleware |\n|---|---|---|---|")  # noqa: T201
    with tempfile.TemporaryDirectory() as tmp:
        for spec, sig in CASES:
            seconds: dict[bool, list[float]] = {False: [], True: []}
            for index in range(runs):
                for middleware in (False, True):
                    workdir = Path(tmp) / f"{spec.name}-{sig.name}-{middleware}-{index}"
                    workdir.mkdir()
                    result = shutdown_run(spec, middleware, sig, workdir, f"r{index}")
                    seconds[middleware].append(result.seconds)
            without, with_ = (statistics.median(seconds[m]) for m in (False, True))
            print(f"| {spec.name} | {sig.name} | {without:.2f} s | {with_:.2f} s |")  # noqa: T201


if __name__ == "__main__":
    main()
