"""Cancel by id across real server processes, through a real Redis (`asgi_cancel.redis`).

`uvicorn --workers 3` (the kernel spreads the connections), and two separate uvicorn processes
standing in for two machines, each with the middleware, a registry and the broker. A cancel by
id sent to any process's endpoint stops the right request, held by the process that answered
or by another: its client gets the 499, the others are untouched. An unknown id answers 404
within the bounded wait. A frozen Redis (SIGSTOP) is logged once by each process and cancels
are answered at once meanwhile. The close-to-cancel latency across processes is printed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..redis_server import RedisServer, running_redis
from .client import connect, get, new_id, read_response, send_request
from .runner import UVICORN_ARGS, Server, ServerSpec, command, running_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

TARGET = "tests.servers.apps:cluster"
WORKERS = 3
THREE_WORKERS = ServerSpec("uvicorn-3-workers", command(*UVICORN_ARGS, "--workers", str(WORKERS)))
ONE = ServerSpec("uvicorn", command(*UVICORN_ARGS))
WATCHDOG = 10.0
SAMPLES = 100


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The module's Redis, the one the servers started meanwhile use."""
    with (
        running_redis(tmp_path_factory.mktemp("redis")) as server,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setenv("ASGI_CANCEL_REDIS_URL", server.url)
        yield server


def pids(server: Server, count: int) -> set[str]:
    """Ask `/whoami` until `count` worker processes have answered (they are all up)."""
    seen: set[str] = set()
    deadline = time.monotonic() + WATCHDOG * 2
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only {len(seen)} workers answered"
        seen.add(get(server.port, "/whoami").body.decode())
    return seen


@pytest.fixture(scope="module")
def workers(
    redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, set[str]]]:
    with running_server(THREE_WORKERS, TARGET, tmp_path_factory.mktemp("workers")) as server:
        yield server, pids(server, WORKERS)
        server.assert_no_traceback()


class Held:
    """A request with its own id, held open on one connection until it is cancelled."""

    def __init__(self, server: Server) -> None:
        self.id = new_id()
        self.sock = connect(server.port, timeout=WATCHDOG)
        send_request(self.sock, "GET", f"/slow?id={self.id}", headers=(("X-Request-Id", self.id),))
        self.pid = str(server.events.wait_for(self.id, "start", timeout=WATCHDOG)["pid"])

    def status(self) -> int:
        return read_response(self.sock).status

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()


def cancel(server: Server, request_id: str, *, answer: bool = False) -> tuple[int, Any, float]:
    """DELETE /v1/requests/{id}: (status, the pid of the process that answered or, `answer`,
    the JSON answer, seconds)."""
    started = time.perf_counter()
    with connect(server.port, timeout=WATCHDOG) as sock:
        send_request(sock, "DELETE", f"/v1/requests/{request_id}")
        response = read_response(sock)
    said = json.loads(response.body) if answer else response.headers["x-worker-pid"]
    return response.status, said, time.perf_counter() - started


def test_requests_spread_and_a_cancel_through_any_worker_stops_the_right_one(
    workers: tuple[Server, set[str]],
) -> None:
    server, all_pids = workers
    held: list[Held] = []
    while {request.pid for request in held} != all_pids:  # until every worker holds one
        assert len(held) < 40, "the kernel never gave a connection to every worker"
        held.append(Held(server))
    held_by_answerer: list[bool] = []  # per cancel: did the worker that answered hold it?
    latencies = []
    try:
        while len(held) < 9:
            held.append(Held(server))
        for victim in held[:6]:
            status, answered_by, took = cancel(server, victim.id)
            assert status == 200
            assert victim.status() == 499
            latencies.append(took)
            held_by_answerer.append(answered_by == victim.pid)
        # Held by another worker than the one that answered: seen (6 tries, 3 workers).
        assert not all(held_by_answerer)
        for untouched in held[6:]:  # (at least three: every worker held one before)
            assert server.events.of(untouched.id, "cancelled") == []
    finally:
        for request in held:
            request.sock.close()
    print(  # noqa: T201 (pytest -s: the figures docs/at-scale.md quotes)
        f"cancel via any of 3 workers: median {statistics.median(latencies) * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms ({sum(held_by_answerer)} held by the answering worker)"
    )


def test_an_unknown_id_answers_404_within_the_bounded_wait(
    workers: tuple[Server, set[str]],
) -> None:
    server, _ = workers
    status, _, took = cancel(server, "nobody-" + new_id())
    assert status == 404
    assert took < 2.0  # every worker said no: not the broker's bound (2 s here)


def test_two_servers_as_two_machines(redis: RedisServer, tmp_path: Path) -> None:
    with (
        running_server(ONE, TARGET, tmp_path / "a") as a,
        running_server(ONE, TARGET, tmp_path / "b") as b,
    ):
        assert cancel(a, "unknown-" + new_id())[0] == 404
        # Cancel -> the held client's 499, through the other server and through its own.
        across = [cancelled_in(a, via=b) for _ in range(SAMPLES)]
        local = [cancelled_in(a, via=a) for _ in range(SAMPLES)]
        a.assert_no_traceback()
        b.assert_no_traceback()
    for name, samples in (("across processes", across), ("in the same process", local)):
        print(  # noqa: T201 (pytest -s: the figures docs/at-scale.md quotes)
            f"cancel by id -> 499, {name}: median {statistics.median(samples) * 1000:.2f} ms, "
            f"p99 {statistics.quantiles(samples, n=100)[98] * 1000:.2f} ms ({SAMPLES} samples)"
        )


def cancelled_in(holder: Server, *, via: Server) -> float:
    """Seconds from the cancel sent to `via` (which answered it, whichever holds the request)
    to the 499 at the client of `holder`'s request."""
    with Held(holder) as held:
        started = time.perf_counter()
        status, answered_by, _ = cancel(via, held.id)
        assert status == 200
        assert (answered_by == held.pid) is (via is holder)
        assert held.status() == 499
        return time.perf_counter() - started


def test_a_worker_stays_serving_while_redis_is_away(
    workers: tuple[Server, set[str]], redis: RedisServer
) -> None:
    """Redis killed mid-run: no request fails or hangs, and a cancel through the worker that
    holds the request still works (reached locally). After the restart, remote cancels work
    again."""
    server, _ = workers
    redis.stop()
    try:
        for _ in range(10):
            assert get(server.port, "/hello", timeout=2.0).body == b"hello"
        with Held(server) as held:
            deadline = time.monotonic() + WATCHDOG
            while True:  # the kernel picks the worker: until the holder itself answers
                status, answered_by, _ = cancel(server, held.id)
                if status == 200:
                    assert answered_by == held.pid
                    break
                assert time.monotonic() < deadline
            assert held.status() == 499
    finally:
        redis.start()
    wait_across(server, via=server)  # reconnected (backoff up to 5 s)


FROZEN_HEALTH = 1.5  # the servers' health_timeout in the freeze test: noticed within 2 s
FREEZE = 8.0  # Redis is resumed after this at the latest, whatever the test does


def test_a_frozen_redis_is_logged_once_and_cancels_are_answered_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stopped with SIGSTOP, as a black-holed network path behaves (the connections stay
    open and silent), between two servers: each logs it once, within 1.3 x health_timeout; a
    cancel of a request the other server holds is answered at once, 404 with `"broker":
    "unreachable"`, not after the broker's `wait` (2 s); requests are served and a cancel
    through the holder works. Resumed, cancels reach across again."""
    (tmp_path / "redis").mkdir()
    with running_redis(tmp_path / "redis") as redis:
        monkeypatch.setenv("ASGI_CANCEL_REDIS_URL", redis.url)
        monkeypatch.setenv("ASGI_CANCEL_REDIS_HEALTH", str(FROZEN_HEALTH))
        with (
            running_server(ONE, TARGET, tmp_path / "a") as a,
            running_server(ONE, TARGET, tmp_path / "b") as b,
        ):
            wait_across(a, via=b)  # both brokers connected
            with redis.frozen(at_most=FREEZE):
                frozen_at = time.monotonic()
                while not all("unreachable" in server.log() for server in (a, b)):
                    assert time.monotonic() < frozen_at + WATCHDOG, "the freeze went unnoticed"
                    time.sleep(0.05)
                noticed = time.monotonic() - frozen_at
                with Held(a) as on_a:
                    status, said, took = cancel(b, on_a.id, answer=True)
                    assert status == 404
                    assert said == {"id": on_a.id, "cancelled": False, "broker": "unreachable"}
                    assert took < 1.0  # at once: not after the broker's wait (2 s)
                    assert get(b.port, "/hello", timeout=2.0).body == b"hello"
                    assert cancel(a, on_a.id)[0] == 200  # the holder itself: local
                    assert on_a.status() == 499
                assert time.monotonic() - frozen_at < FREEZE  # all of the above while frozen
            wait_across(a, via=b)
            for server in (a, b):
                assert server.log().count("unreachable") == 1, server.log()[-4000:]
                assert "asgi_cancel: asgi_cancel:" not in server.log()
                server.assert_no_traceback()
    assert noticed < FROZEN_HEALTH * 1.3 + 1.0  # the documented bound, 1 s for a loaded machine


def wait_across(holder: Server, *, via: Server) -> None:
    """Until a cancel sent to `via` and answered by another process than the one that holds the
    request stops it (the brokers connected): its client gets the 499."""
    deadline = time.monotonic() + WATCHDOG
    while True:
        with Held(holder) as held:
            status, answered_by, _ = cancel(via, held.id)
            if status == 200 and answered_by != held.pid:
                assert held.status() == 499
                return
        assert time.monotonic() < deadline, "cancels never reached across"
        time.sleep(0.1)
