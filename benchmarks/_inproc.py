"""In-process ASGI-level measurements, run in a child interpreter (3.11 or 3.12) per group.

`python -m benchmarks._inproc micro VARIANT [VARIANT ...] --requests N --rounds R`
`python -m benchmarks._inproc memory VARIANT --requests N --batch B`

Both print one JSON object. The fake server below behaves like uvicorn's
`RequestResponseCycle`: the body arrives at once, a later `receive()` waits until the client
leaves or the response is complete and then returns `http.disconnect` to every caller, as often
as asked, and `send()` never yields. One task per request, as a server creates.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

from asgi_cancel.types import ASGIApp, Message

from ._util import median, rss_bytes
from .alternatives import build

_REQUEST: Message = {"type": "http.request", "body": b"", "more_body": False}
_DISCONNECT: Message = {"type": "http.disconnect"}


class FakeConnection:
    __slots__ = ("disconnected", "event", "request_sent", "response_complete", "sent")

    def __init__(self) -> None:
        self.request_sent = False
        self.disconnected = False
        self.response_complete = False
        self.event: asyncio.Event | None = None
        self.sent = 0

    async def receive(self) -> Message:
        if not self.request_sent:
            self.request_sent = True
            return dict(_REQUEST)
        if not (self.disconnected or self.response_complete):
            if self.event is None:
                self.event = asyncio.Event()
            await self.event.wait()
        return dict(_DISCONNECT)

    async def send(self, message: Message) -> None:
        if self.disconnected:
            return
        self.sent += 1
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.response_complete = True
            if self.event is not None:
                self.event.set()

    def disconnect(self) -> None:
        self.disconnected = True
        if self.event is not None:
            self.event.set()


def make_scope(path: str, query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # as uvicorn 0.54 advertises
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def call(awaitable: Awaitable[None]) -> Coroutine[Any, Any, None]:
    """An ASGI app returns a coroutine (typed as an awaitable): hand it to create_task."""
    return cast(Coroutine[Any, Any, None], awaitable)


class TaskCounter:
    def __init__(self) -> None:
        self.created = 0

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        self.created += 1
        return asyncio.Task(coro, loop=loop, **kwargs)


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(main: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    loop = new_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


# -- micro: a hello world, request after request ----------------------------------------------
async def one_hello(app: ASGIApp, loop: asyncio.AbstractEventLoop) -> None:
    connection = FakeConnection()
    await loop.create_task(call(app(make_scope("/"), connection.receive, connection.send)))
    if not connection.response_complete:
        raise RuntimeError("the hello world did not complete its response")


async def micro(variants: list[str], requests: int, rounds: int, quick: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    warm, counted, traced = (20, 20, 30) if quick else (200, 200, 300)
    apps = {variant: build(variant, "hello") for variant in variants}
    for app in apps.values():  # warm up: build middleware stacks, fill caches
        for _ in range(warm):
            await one_hello(app, loop)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    gc.collect()
    for round_number in range(rounds):
        # Alternate the order every round so that no variant always follows the same one.
        order = variants if round_number % 2 == 0 else variants[::-1]
        for variant in order:
            app = apps[variant]
            started = time.perf_counter()
            for _ in range(requests):
                await one_hello(app, loop)
            times[variant].append((time.perf_counter() - started) / requests * 1e6)
            await asyncio.sleep(0)  # let cancelled helper tasks finish outside the timing

    out: dict[str, Any] = {"requests": requests, "rounds": rounds, "variants": {}}
    for variant, app in apps.items():
        counter = TaskCounter()
        loop.set_task_factory(counter)  # type: ignore[arg-type]  # typeshed: no **kwargs
        for _ in range(counted):
            await one_hello(app, loop)
        await asyncio.sleep(0.01)
        loop.set_task_factory(None)
        # Per-request high-water mark of live allocations, and what a request leaves behind.
        peaks: list[int] = []
        gc.collect()
        tracemalloc.start()
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(traced):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            await one_hello(app, loop)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
        await asyncio.sleep(0.01)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - first
        tracemalloc.stop()
        # Objects that only the cyclic garbage collector frees (reference cycles per request),
        # and how many collections a stream of requests triggers: deterministic, unlike time.
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        stats_before = gc.get_stats()
        for _ in range(counted):
            await one_hello(app, loop)
        await asyncio.sleep(0.01)
        stats_after = gc.get_stats()
        gc.collect()
        cyclic = len(gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        collections = sum(
            a["collections"] - b["collections"]
            for a, b in zip(stats_after, stats_before, strict=True)
        )
        out["variants"][variant] = {
            "cyclic_garbage_per_request": cyclic / counted,
            "gc_collections_per_1k": collections / counted * 1000,
            "us_per_request": times[variant],
            "us_median": median(times[variant]),
            # The fake server's own task per request is not counted.
            "tasks_per_request": counter.created / counted - 1,
            "peak_alloc_bytes": median(peaks),
            "retained_bytes_per_request": retained / traced,
        }
    return out


# -- instr: phases for callgrind, which counts instructions (deterministic, load-independent) --
async def instr(variants: list[str], requests: int) -> dict[str, Any]:
    """Run under `valgrind --tool=callgrind --dump-before=getppid`: each `os.getppid()` closes
    a part, so part 2k (1-based) holds exactly the k-th variant's `requests` hello worlds."""
    loop = asyncio.get_running_loop()
    for variant in variants:
        app = build(variant, "hello")
        for _ in range(100):
            await one_hello(app, loop)
        await asyncio.sleep(0.01)
        gc.collect()
        os.getppid()
        for _ in range(requests):
            await one_hello(app, loop)
        os.getppid()
    return {"variants": variants, "requests": requests}


# -- memory: many requests, each cancelled by a disconnect -------------------------------------
async def memory(variant: str, requests: int, batch: int, patience: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    started = 0
    cancelled = 0

    def record(request_id: int, event: str) -> None:
        nonlocal started, cancelled
        if event == "start":
            started += 1
        elif event == "cancelled":
            cancelled += 1

    app = build(variant, "slow", hold=3600.0, record=record)

    async def one_batch(size: int) -> tuple[int, int]:
        nonlocal started
        started = 0
        connections = [FakeConnection() for _ in range(size)]
        tasks = [
            loop.create_task(
                call(app(make_scope("/slow", b"id=%d" % index), conn.receive, conn.send))
            )
            for index, conn in enumerate(connections)
        ]
        for _ in range(1000):  # until every handler is parked in its work
            if started >= size:
                break
            await asyncio.sleep(0)
        for connection in connections:
            connection.disconnect()
        _done, pending = await asyncio.wait(tasks, timeout=patience)
        for task in pending:  # the alternative never cancelled it: shut it down as a server would
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{variant}: the app raised") from task.exception()
        return size - len(pending), len(pending)

    for _ in range(2):  # warm-up at full batch size: the high-water mark is reached here
        await one_batch(batch)
    await asyncio.sleep(0.05)
    series: list[tuple[int, int]] = []
    gc.collect()
    own = len(asyncio.all_tasks())
    rss_before = rss_bytes()
    objects_before = len(gc.get_objects())
    cancelled = 0
    ended = leftover = 0
    t0 = time.perf_counter()
    remaining = requests
    while remaining > 0:
        size = min(batch, remaining)
        ok, stuck = await one_batch(size)
        ended += ok
        leftover += stuck
        remaining -= size
        series.append((requests - remaining, rss_bytes()))
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(0.05)  # helper tasks that were cancelled but not awaited finish now
    gc.collect()
    rss_after = rss_bytes()
    live_tasks = len(asyncio.all_tasks()) - own
    objects_delta = len(gc.get_objects()) - objects_before
    # One more batch, to count what only the cyclic collector frees (exception/traceback
    # cycles...): between collections, that garbage is what makes RSS climb.
    probe = min(batch, 500)
    gc.set_debug(gc.DEBUG_SAVEALL)
    await one_batch(probe)
    await asyncio.sleep(0.05)
    gc.collect()
    cyclic = len(gc.garbage)
    gc.garbage.clear()
    gc.set_debug(0)
    return {
        "variant": variant,
        "requests": requests,
        "batch": batch,
        "work_cancelled": cancelled,
        "ended_by_disconnect": ended,
        "never_cancelled": leftover,
        "seconds": elapsed,
        "rss_before": rss_before,
        "rss_after": rss_after,
        # RSS after each batch: a leak is a slope, a high-water mark is a step at the start.
        "rss_series": series,
        "live_tasks_after": live_tasks,
        "gc_objects_delta": objects_delta,
        "cyclic_garbage_per_request": cyclic / probe,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._inproc")
    sub = parser.add_subparsers(dest="command", required=True)
    micro_parser = sub.add_parser("micro")
    micro_parser.add_argument("variants", nargs="+")
    micro_parser.add_argument("--requests", type=int, default=2000)
    micro_parser.add_argument("--rounds", type=int, default=7)
    micro_parser.add_argument("--quick", action="store_true")
    instr_parser = sub.add_parser("instr")
    instr_parser.add_argument("variants", nargs="+")
    instr_parser.add_argument("--requests", type=int, default=500)
    memory_parser = sub.add_parser("memory")
    memory_parser.add_argument("variant")
    memory_parser.add_argument("--requests", type=int, default=100_000)
    memory_parser.add_argument("--batch", type=int, default=1000)
    memory_parser.add_argument("--patience", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "micro":
        result = run(lambda: micro(args.variants, args.requests, args.rounds, args.quick))
    elif args.command == "instr":
        result = run(lambda: instr(args.variants, args.requests))
    else:
        result = run(lambda: memory(args.variant, args.requests, args.batch, args.patience))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
