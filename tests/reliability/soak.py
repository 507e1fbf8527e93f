"""Soak a real server: many requests from a few client threads, half of them leaving early.

    .venv/bin/python -m tests.reliability.soak --requests 20000     # each server, ~minutes
    .venv/bin/python -m tests.reliability.soak --requests 20000 --h2-requests 3000  # h2c is slow

Every completed response is checked byte for byte; the server's asyncio task count and RSS
(its `/stats` endpoint) are read before and after; its log must hold no traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers.client import FIN, RST, close, connect, fetch, get, send_request
from tests.servers.events import chunk
from tests.servers.h2_client import H2Client
from tests.servers.runner import HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS, Server, running_server

TARGET = "tests.servers.apps:hookless_app"
# Our tasks (the middleware's, the app's) must be gone by then.
SETTLE_TIMEOUT = 30.0


@dataclass
class Stats:
    tasks: int  # every asyncio task of the server process
    ours: int  # those running the middleware's or the app's code
    rss_kib: int
    stacks: list[list[str]] = field(default_factory=list)  # of ours, when asked for


@dataclass
class SoakResult:
    server: str
    before: Stats
    after: Stats | None = None  # once the run is over and the tasks settled
    requests: int = 0
    completed: int = 0
    departures: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answered(self, kind: str, status: int | None, body: bytes, expected: bytes) -> None:
        with self.lock:
            self.completed += 1
            if status != 200 or body != expected:
                self.errors.append(f"{kind}: {status} {body[:80]!r}")

    def left(self, how: str) -> None:
        with self.lock:
            self.departures[how] += 1


def stats(port: int, *, stacks: bool = False) -> Stats:
    data = json.loads(get(port, "/stats?stacks=1" if stacks else "/stats").body)
    return Stats(data["tasks"], data["ours"], data["rss_kib"], data.get("stacks", []))


def leave(sock: socket.socket, rng: random.Random) -> str:
    how = RST if rng.random() < 0.5 else FIN
    close(sock, how)
    return how


# What a request of each kind asks and must answer when it stays; what it asks when it leaves
# (a worker thread cannot be cancelled: 5 s threads would fill the default executor, 6 threads
# here, and queue every other thread call behind them).
STAYS = {
    "hello": ("/hello", b"hello"),
    "stream": ("/stream?n=20&every=0.002", b"".join(chunk(index) for index in range(20))),
    "slow": ("/slow?t=0.01", b"slow done"),
    "thread": ("/thread?t=0.01", b"thread done"),
}
LEAVES = {
    "hello": "/hello",
    "stream": "/stream?n=500&every=0.002",
    "slow": "/slow?t=5",
    "thread": "/thread?t=0.05",
}


def one_http1(port: int, rng: random.Random, result: SoakResult) -> None:
    kind = rng.choice(["hello", "echo", "stream", "slow", "thread"])
    leaving = rng.random() < 0.5
    if not leaving:
        if kind == "echo":
            sent = rng.randbytes(rng.randint(0, 20000))
            response = fetch(port, "POST", "/echo", sent)
            expected = sent
        else:
            target, expected = STAYS[kind]
            response = fetch(port, "GET", target)
        result.answered(kind, response.status, response.body, expected)
        return
    where = rng.choice(["headers", "mid-body", "mid-stream", "in-thread"])
    sock = connect(port)
    if where == "mid-body":
        part = rng.randbytes(rng.randint(0, 20000))
        send_request(sock, "POST", "/echo", headers=(("Content-Length", "50000"),), body=part)
    elif where == "mid-stream":
        send_request(sock, "GET", "/stream?n=500&every=0.002")
        sock.recv(rng.randint(1, 400))
    else:
        send_request(sock, "GET", "/slow?t=5" if where == "headers" else "/thread?t=0.02")
        time.sleep(rng.uniform(0, 0.01))
    result.left(f"{where}/{leave(sock, rng)}")


def h2_client(port: int, count: int, rng: random.Random, result: SoakResult) -> None:
    done = 0
    while done < count:
        with connect(port) as sock:
            client = H2Client(sock, port)
            while done < count:
                done += 1
                kind = rng.choice(["hello", "stream", "slow", "thread"])
                leaving = rng.random() < 0.5
                stream_id = client.get(LEAVES[kind] if leaving else STAYS[kind][0])
                if not leaving:
                    client.read_until_ended(stream_id)
                    body = client.body.get(stream_id, b"")
                    result.answered(
                        f"h2 {kind}", client.status.get(stream_id), body, STAYS[kind][1]
                    )
                    continue
                time.sleep(rng.uniform(0, 0.01))
                if rng.random() < 0.8:
                    client.reset_stream(stream_id)
                    result.left(f"h2-{kind}/rst-stream")
                else:
                    result.left(f"h2-{kind}/conn-{leave(sock, rng)}")
                    break


def settle(port: int, baseline: int) -> Stats:
    """Wait until the server's task count is back to its baseline (or the deadline)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        current = stats(port)
        if current.ours <= baseline:
            return current
        if time.monotonic() > deadline:
            return stats(port, stacks=True)  # where the tasks left behind wait
        time.sleep(0.1)


def soak(
    server: Server, *, requests: int, clients: int = 4, h2: bool = False, seed: int = 13
) -> SoakResult:
    for _ in range(20):  # warm up: imports, the thread pool, the first connections
        get(server.port, "/hello")
        fetch(server.port, "GET", "/thread?t=0")
    result = SoakResult(server.spec.name + ("-h2c" if h2 else ""), before=stats(server.port))
    per_client = requests // clients
    started = time.monotonic()

    def run(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        try:
            if h2:
                h2_client(server.port, per_client, rng, result)
            else:
                for _ in range(per_client):
                    one_http1(server.port, rng, result)
        except Exception as exc:  # a client error is a finding, not a crash of the soak
            with result.lock:
                result.errors.append(f"client {index}: {exc!r}")

    threads = [threading.Thread(target=run, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    result.requests = per_client * clients
    result.after = settle(server.port, result.before.ours)
    return result


SPECS = [(UVICORN_HTTPTOOLS, False), (HYPERCORN_ASYNCIO, False), (HYPERCORN_ASYNCIO, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000, help="per server")
    parser.add_argument(
        "--h2-requests", type=int, default=None, help="for hypercorn h2c (default: --requests)"
    )
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    for spec, h2 in SPECS:
        requests = args.h2_requests if h2 and args.h2_requests is not None else args.requests
        with tempfile.TemporaryDirectory() as workdir:
            with running_server(spec, TARGET, Path(workdir)) as server:
                result = soak(server, requests=requests, clients=args.clients, h2=h2)
                traceback = "Traceback" in server.log()
            print(report(result, traceback))  # noqa: T201


def report(result: SoakResult, traceback: bool) -> str:
    assert result.after is not None
    return (
        f"{result.server}: {result.requests} requests in {result.seconds:.1f} s, "
        f"{result.completed} completed, {sum(result.departures.values())} departures "
        f"({dict(sorted(result.departures.items()))}), errors {len(result.errors)} "
        f"{result.errors[:3]}, tasks {result.before.tasks} -> {result.after.tasks} "
        f"(ours {result.before.ours} -> {result.after.ours}), "
        f"RSS {result.before.rss_kib / 1024:.1f} -> {result.after.rss_kib / 1024:.1f} MiB, "
        f"traceback in log: {traceback}"
    )


if __name__ == "__main__":
    main()
