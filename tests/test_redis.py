"""`asgi_cancel.redis.RedisBroker` against a real Redis: cancels by id between processes.

Each "process" here is an event loop in a thread with its own `CancelRegistry` and broker on
the same Redis and channel. A cancel through any process, and an unknown id answered as soon as
every process said no: tests/servers/test_cluster.py, with real server processes. Here: a
cancel that arrives before its request stops it when it comes; and faults (Redis away at
start, killed mid-run and restarted, frozen, busy, slow, hostile messages) never harm a
request, keep local cancels working and are logged once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from logging import WARNING
from pathlib import Path
from typing import Any

import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry
from asgi_cancel._redis_listener import Listener
from asgi_cancel.redis import RedisBroker
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import Node, respond
from .redis_server import RedisServer, running_redis
from .servers.process import free_port

WATCHDOG = 10.0
HEALTH = 1.5  # health_timeout where Redis freezes or is busy: a freeze is noticed within 2 s
FREEZE = 8.0  # a frozen Redis is resumed after this at the latest, whatever the test does


def cancel_running(holder: Node, canceller: Node, request_id: str) -> None:
    """A request on `holder`, cancelled through `canceller`: held, and answered 499."""
    request = holder.start_request(request_id)
    holder.wait_registered(request_id)
    assert canceller.acancel(request_id)[0] is True
    assert request.result(WATCHDOG).status == 499


def wait_connected(nodes: Sequence[Node], connected: bool = True) -> None:
    for node in nodes:
        node.wait_connected(connected)


@contextmanager
def nodes_on(url: str, *names: str, **options: Any) -> Iterator[list[Node]]:
    """A process for each of `names` on the Redis at `url`, connected; closed at the end."""
    made = [Node(url, name, **options) for name in names]
    try:
        wait_connected(made)
        yield made
    finally:
        for node in made:
            node.close()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture
def nodes(redis: RedisServer) -> Iterator[list[Node]]:
    with nodes_on(redis.url, "a", "b", "c") as made:
        yield made


def test_a_cancel_that_arrives_before_its_request_stops_it_when_it_comes(nodes: list[Node]) -> None:
    a, b, _ = nodes
    held, _ = a.acancel("early")
    assert held is False  # nothing held it yet: 404 from the endpoint
    conn = b.start_request("early").result(WATCHDOG)
    assert conn.status == 499  # ... but it is stopped as it arrives, its app never runs
    assert b.events == []
    time.sleep(b.registry.remember + 0.1)
    later = b.start_request("early")
    b.wait_registered("early")  # remembered no longer: a new request with the id runs
    assert b.acancel("early")[0] is True
    assert later.result(WATCHDOG).status == 499


def test_a_request_that_comes_to_the_sender_while_it_awaits_the_answers_is_refused(
    nodes: list[Node],
) -> None:
    # c is busy (a long synchronous step): a's cancel waits the broker's whole `wait` for its
    # answer. A request with the id that reaches a meanwhile is refused, as on b or c.
    a, _, c = nodes
    c.block(1.5)
    cancelling = asyncio.run_coroutine_threadsafe(a.registry.acancel("req-7"), a.loop)
    time.sleep(0.1)
    assert a.start_request("req-7").result(WATCHDOG).status == 499
    assert cancelling.result(WATCHDOG) is False  # nobody held it: 404 from the endpoint
    assert a.events == []  # its app never ran


def test_aclose_ends_the_listener_when_its_cancel_meets_a_read_timeout(redis: RedisServer) -> None:
    # The loop wakes from a long step with the listener's read timeout expired and aclose's
    # cancel due in the same step: redis-py's read timeout (async-timeout on 3.10) takes that
    # cancel for its own expiry and the listener would read on, and aclose wait for it.
    with nodes_on(redis.url, "a", health_timeout=HEALTH) as (node,):
        listener = node.broker._task
        node.block(0.5)
        closing = asyncio.run_coroutine_threadsafe(node.broker.aclose(), node.loop)
        closing.result(HEALTH)  # within a read timeout (0.15 s) of the block's end, not never
        assert listener.done()
        assert node.broker.connected is False


def test_stopping_a_listener_that_never_ends_is_bounded_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Whatever the listener is stuck in (an await that swallows every cancel), closing the
    # broker at shutdown gives up after health_timeout, and says so.
    listener = Listener(
        "redis://127.0.0.1:1/0",
        ("c",),
        connect_timeout=0.1,
        health_timeout=0.3,
        deliver=respond_nothing,
        reachable=lambda client: None,
    )

    released = False

    async def stubborn() -> None:
        while not released:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    async def main() -> float:
        task = asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        started = time.monotonic()
        await asyncio.wait_for(listener.stop(task), WATCHDOG)
        waited = time.monotonic() - started
        assert not task.done()
        nonlocal released
        released = True  # (the test's own clean-up)
        await asyncio.wait_for(task, WATCHDOG)
        return waited

    assert 0.3 <= asyncio.run(main()) < WATCHDOG
    assert [r.getMessage() for r in caplog.records if r.levelno >= WARNING] == [
        "the broker's listener did not stop in 0.3 s"
    ]


async def respond_nothing(data: object) -> None:
    pass


@pytest.mark.parametrize("aliased", [True, False], ids=["aliased", "control-no-alias"])
def test_a_cancel_by_an_alias_reaches_the_process_that_holds_it(
    nodes: list[Node], aliased: bool
) -> None:
    a, b, _ = nodes
    running = b.start_request("own-id", "chatcmpl-own-id" if aliased else None)
    b.wait_registered("own-id")
    held, _ = a.acancel("chatcmpl-own-id")
    assert held is aliased
    if not aliased:  # the control: not found anywhere, and it runs on
        assert b.events == ["own-id started"]
        assert a.acancel("own-id")[0] is True
    assert running.result(WATCHDOG).status == 499
    assert b.events == ["own-id started", "own-id cancelled"]
    assert "chatcmpl-own-id" not in b.registry


def test_hostile_messages_on_the_channel_are_ignored(
    nodes: list[Node], redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, _ = nodes
    request = b.start_request("target")
    b.wait_registered("target")
    junk = [
        b"not json",
        b"x" * 100_000,
        json.dumps({"v": 1, "op": "cancel", "id": "../target", "from": "x", "nonce": ""}).encode(),
        json.dumps({"v": 1, "op": "cancel", "id": "t" * 201, "from": "x", "nonce": ""}).encode(),
        json.dumps({"v": 2, "op": "cancel", "id": "target", "from": "x", "nonce": ""}).encode(),
        json.dumps(["cancel", "target"]).encode(),
        b"[" * 1000,  # nests past the JSON parser's limit: RecursionError, not ValueError
    ]
    for data in junk:
        publish(redis, "asgi-cancel", data)
    time.sleep(0.2)
    assert "target" in b.registry  # still running: nothing of that was a cancel of ours
    noticed = [record.getMessage() for record in caplog.records if record.levelno >= WARNING]
    assert noticed == []  # nothing of that cost a connection (a restart, an outage logged)
    assert a.acancel("target")[0] is True  # and the broker still works
    assert request.result(WATCHDOG).status == 499


def publish(redis: RedisServer, channel: str, data: bytes) -> None:
    """PUBLISH over a raw socket (RESP), as anyone who can reach Redis could."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=5) as sock:
        sock.sendall(command(b"PUBLISH", channel.encode(), data))
        assert sock.recv(64).startswith(b":")


def command(*parts: bytes) -> bytes:
    """A Redis command in RESP."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def test_redis_unreachable_at_start_keeps_local_cancels_working(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_cancel")
    node = Node(f"redis://127.0.0.1:{free_port()}/0", "alone")
    try:
        time.sleep(0.5)  # a few reconnect attempts
        assert node.broker.connected is False
        cancel_running(node, node, "local")
        held, took = node.acancel("unknown")
        assert held is False
        assert took < 0.1  # Redis away: no waiting for answers that cannot come
        answer = {"id": "unknown", "cancelled": False, "broker": "unreachable"}
        assert node.endpoint_cancel("unknown") == (404, answer)  # and the answer says so
    finally:
        node.close()
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1  # once per outage, not per attempt or per request


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_redis_away_mid_run_is_noticed_once_cancels_answer_at_once_then_work_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """Redis killed (then restarted on its port), or stopped with SIGSTOP (its connections stay
    open and silent, as behind a black-holed network path). Each broker notices (a freeze
    within 1.3 x health_timeout) and logs it once; a cancel no local request holds is answered
    at once (404, "broker": "unreachable"), not after `wait`; requests run and local cancels
    work. Once Redis is back, the brokers reconnect by themselves, each logs it once, and
    cancels reach across again."""
    caplog.set_level(logging.INFO, logger="asgi_cancel")
    # A kill closes the connections: noticed without the health check (left at its 10 s).
    options = {"wait": 5.0, "health_timeout": HEALTH if fault == "frozen" else 10.0}
    with running_redis(tmp_path) as redis, nodes_on(redis.url, "a", "b", **options) as (a, b):
        if fault == "killed":
            redis.stop()
        with redis.frozen(at_most=FREEZE) if fault == "frozen" else nullcontext():
            away_at = time.monotonic()
            wait_connected((a, b), False)
            noticed = time.monotonic() - away_at
            request = b.start_request("during-outage")
            b.wait_registered("during-outage")
            held, took = a.acancel("during-outage")  # held by b, which Redis cannot reach
            assert held is False
            assert took < a.broker.wait / 2  # answered at once, not after `wait` (5 s)
            unreachable = {"id": "elsewhere", "cancelled": False, "broker": "unreachable"}
            assert a.endpoint_cancel("elsewhere") == (404, unreachable)
            assert b.acancel("during-outage")[0] is True  # local cancels work
            assert request.result(WATCHDOG).status == 499
            assert time.monotonic() - away_at < FREEZE  # all of the above while away
        if fault == "killed":
            redis.start()
        wait_connected((a, b))
        cancel_running(b, a, "after-outage")  # across again
        assert a.endpoint_cancel("nobody") == (404, {"id": "nobody", "cancelled": False})
    assert noticed < HEALTH * 1.3 + 1.0  # the documented bound, and 1 s for a loaded machine
    records = [r for r in caplog.records if r.name == "asgi_cancel"]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # once per broker, not per reconnect attempt
    why = "unreachable (no answer in 1.5 s)" if fault == "frozen" else "unreachable ("
    assert all(why in message for message in warnings), warnings
    assert sum("reachable again" in r.getMessage() for r in records) == 2
    assert not [r for r in records if r.getMessage().startswith("asgi_cancel:")]


def test_a_busy_redis_is_not_taken_as_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A script that keeps Redis busy for 2 x health_timeout: Redis answers the broker's pings
    with BUSY (after its busy-reply threshold, 0.2 s here, 5 s by default), so it is busy, not
    away: no warning, the brokers stay connected, and cancels reach across as before."""
    caplog.set_level(logging.INFO, logger="asgi_cancel")
    with (
        running_redis(tmp_path, args=["--lua-time-limit", "200"]) as redis,
        nodes_on(redis.url, "a", "b", health_timeout=HEALTH) as (a, b),
    ):
        busy_for = int(2 * HEALTH * 1_000_000)  # microseconds
        script = (
            "local t = redis.call('TIME') while true do local n = redis.call('TIME') "
            f"if (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > {busy_for} then return 1 end end"
        )
        with socket.create_connection(("127.0.0.1", redis.port), timeout=WATCHDOG) as sock:
            sock.sendall(command(b"EVAL", script.encode(), b"0"))
            sock.settimeout(0.05)
            deadline = time.monotonic() + WATCHDOG
            while True:  # until the script is done: the brokers stay connected throughout
                assert time.monotonic() < deadline, "the script never ended"
                assert a.broker.connected
                assert b.broker.connected
                try:
                    assert sock.recv(64) == b":1\r\n"
                    break
                except TimeoutError:
                    pass
        cancel_running(b, a, "after-busy")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class DelayingProxy:
    """A TCP proxy to Redis that holds every chunk `delay` seconds: a slow Redis."""

    def __init__(self, target: int, delay: float) -> None:
        self.target, self.delay = target, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(self.delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self.listener.close()


def test_a_slow_redis_never_slows_a_request_that_is_not_cancelled(redis: RedisServer) -> None:
    proxy = DelayingProxy(redis.port, delay=1.0)
    node = Node(f"redis://127.0.0.1:{proxy.port}/0", "slow")
    try:

        async def hello(scope: Scope, receive: Receive, send: Send) -> None:
            await asyncio.sleep(0.001)
            await respond(send, b"ok")

        async def serve_many() -> float:
            middleware = CancelOnDisconnectMiddleware(hello, registry=node.registry)
            started = time.perf_counter()
            for index in range(50):
                conn = ClientConnection()
                scope = http_scope(headers=[(b"x-request-id", b"r%d" % index)])
                await conn.run(middleware, scope)
                assert conn.status == 200
            return time.perf_counter() - started

        # 50 requests, each registered and unregistered with the broker on a 1 s-per-chunk
        # Redis: they take no longer than a few milliseconds each, as without a broker.
        assert node.run(serve_many()) < 1.0
    finally:
        node.close()
        proxy.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"url": "http://127.0.0.1:6379"}, "url"),
        ({"url": b"redis://127.0.0.1"}, "url"),
        ({"channel": ""}, "channel"),
        ({"channel": "c" * 101}, "channel"),
        # (Those in seconds: test_validate.py.)
    ],
)
def test_a_bad_option_is_a_value_error_naming_it(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} must be"):
        RedisBroker(**{"url": "redis://127.0.0.1:1/0", **options})


def test_one_registry_per_broker_no_credentials_shown_local_without_a_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = RedisBroker("redis://user:s3cret@127.0.0.1:1/0")
    registry = CancelRegistry(broker=broker)
    broker.bind(registry)  # the same one again: fine
    with pytest.raises(ValueError, match="one CancelRegistry"):
        CancelRegistry(broker=broker)
    assert "s3cret" not in repr(broker)
    assert "127.0.0.1:1" in repr(broker)
    with caplog.at_level(logging.WARNING, logger="asgi_cancel"):
        broker.start_soon()  # no running loop: nothing to listen in
    (message,) = [r.getMessage() for r in caplog.records]
    assert message == "RedisBroker needs asyncio; cancels stay local here"
    assert asyncio.run(broker.cancel_elsewhere("r1", "cancelled by id")) is False
