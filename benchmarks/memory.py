"""4. Memory and leaks: many requests, each cancelled by a disconnect, in process.

Each variant runs in a fresh interpreter (`python -m benchmarks.memory VARIANT N BATCH`): batches
of requests park in their work, then every client leaves. The fake server acts like uvicorn's
`RequestResponseCycle` (`http.disconnect` to every `receive()` once the client left). Reported:
RSS, its growth after the first tenth (a leak is a slope), tasks and objects left, and the
objects only the cyclic collector frees.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

from asgi_cancel.types import Message

from ._util import ROOT, emit, facts, fmt, table
from .alternatives import VARIANTS, build, python, runnable

MEMORY_VARIANTS = [
    *("asgi-cancel", "vllm", "poll-1s", "poll-0.1s", "streaming"),
    *("asgi-cancel-py312", "fastapi-disconnect", "fastapi-disconnect-decorator"),
]
QUICK_VARIANTS = ["asgi-cancel", "vllm", "poll-0.1s", "streaming", "fastapi-disconnect"]
NEVER_CANCEL = {  # every request would stay alive for the hour: not run
    name: "never cancels (see the latency table)"
    for name in ("baseline", "poll-1s+bhm", "poll-0.1s+bhm")
}


class FakeConnection:
    def __init__(self) -> None:
        self.body_sent, self.over = False, asyncio.Event()  # over: the client left, or done

    async def receive(self) -> Message:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.over.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.over.set()


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def child(variant: str, requests: int, batch: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    started = 0

    def count(request_id: int, event: str) -> None:
        nonlocal started
        started += event == "start"

    app = build(variant, "slow", hold=3600.0, record=count)

    async def one_batch(size: int) -> int:
        """Start `size` requests, disconnect them all once they work; return how many ended."""
        nonlocal started
        started = 0
        connections = [FakeConnection() for _ in range(size)]
        calls = [app(_scope(i), c.receive, c.send) for i, c in enumerate(connections)]
        tasks = [loop.create_task(cast(Coroutine[Any, Any, None], call)) for call in calls]
        for _ in range(1000):  # until every handler is parked in its work
            if started >= size:
                break
            await asyncio.sleep(0)
        for connection in connections:
            connection.over.set()
        _done, pending = await asyncio.wait(tasks, timeout=5.0)
        for task in pending:  # never cancelled by the alternative: shut down as a server would
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{variant}: the app raised") from task.exception()
        return size - len(pending)

    for _ in range(2):  # warm-up at full batch size: the high-water mark is reached here
        await one_batch(batch)
    series: list[tuple[int, int]] = []  # (requests done, RSS) after each batch
    await asyncio.sleep(0.05)
    gc.collect()
    own_tasks, objects_before = len(asyncio.all_tasks()), len(gc.get_objects())
    rss_before, ended = rss_bytes(), 0
    clock = time.perf_counter()
    for done in range(0, requests, batch):
        ended += await one_batch(min(batch, requests - done))
        series.append((min(done + batch, requests), rss_bytes()))
    elapsed = time.perf_counter() - clock
    await asyncio.sleep(0.05)  # helper tasks that were cancelled but not awaited finish now
    gc.collect()
    result: dict[str, Any] = {"requests": requests, "ended_by_disconnect": ended}
    result |= {"seconds": elapsed, "rss_before": rss_before, "rss_after": rss_bytes()}
    result["rss_series"] = series
    result |= {"live_tasks_after": len(asyncio.all_tasks()) - own_tasks}
    result["gc_objects_delta"] = len(gc.get_objects()) - objects_before
    # One more batch, to count what only the cyclic collector frees (exception and traceback
    # cycles): between collections, that garbage is what makes RSS climb.
    probe = min(batch, 500)
    gc.set_debug(gc.DEBUG_SAVEALL)
    await one_batch(probe)
    await asyncio.sleep(0.05)
    gc.collect()
    result["cyclic_garbage_per_request"] = len(gc.garbage) / probe
    gc.garbage.clear()
    gc.set_debug(0)
    return result


def _scope(index: int) -> dict[str, Any]:  # as uvicorn makes it
    scope: dict[str, Any] = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    scope |= {"http_version": "1.1", "method": "GET", "scheme": "http", "path": "/slow"}
    scope |= {"raw_path": b"/slow", "query_string": b"id=%d" % index, "root_path": ""}
    scope |= {"headers": [(b"host", b"127.0.0.1:8000")], "client": ("127.0.0.1", 50000)}
    return scope | {"server": ("127.0.0.1", 8000), "state": {}}


def run(quick: bool) -> dict[str, Any]:
    skipped = dict(NEVER_CANCEL)
    variants = runnable(QUICK_VARIANTS if quick else MEMORY_VARIANTS, skipped)
    requests, batch = (2_000, 500) if quick else (100_000, 2_000)
    emit(f"memory: {requests:,} cancelled requests per variant, in process")
    results: dict[str, Any] = {}
    for variant in variants:
        command = [python(variant), "-m", "benchmarks.memory", variant, str(requests), str(batch)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"memory {variant} failed:\n{done.stderr[-3000:]}")
        results[variant] = json.loads(done.stdout)
        emit(f"  {variant}: done in {results[variant]['seconds']:.1f} s")
    settings = {"requests": requests, "batch": batch}
    return {"settings": settings, "variants": variants, "skipped": skipped, "results": results}


def check(data: dict[str, Any]) -> list[str]:
    ours = data["results"]["asgi-cancel"]
    if ours["ended_by_disconnect"] != ours["requests"] or ours["live_tasks_after"]:
        return [f"memory: asgi-cancel did not end every request, or left tasks: {ours}"]
    return []


def late_growth(row: dict[str, Any]) -> float:
    """RSS growth after the first tenth of the requests: what a leak would keep adding."""
    series = row["rss_series"]
    tenth = next((rss for done, rss in series if done >= row["requests"] / 10), series[0][1])
    return float(series[-1][1] - tenth)


def render(data: dict[str, Any]) -> str:
    mib = 1024 * 1024
    rows: list[list[object]] = []
    for variant in data["variants"]:
        row = data["results"][variant]
        rows.append([VARIANTS[variant], f"{row['ended_by_disconnect']:,}/{row['requests']:,}"])
        growth = row["rss_after"] - row["rss_before"]
        rows[-1] += [fmt(row["rss_before"] / mib), fmt(growth / mib)]
        rows[-1] += [fmt(late_growth(row) / mib), row["live_tasks_after"]]
        rows[-1] += [f"{row['gc_objects_delta']:+,}", fmt(row["cyclic_garbage_per_request"], 0)]
        rows[-1].append(fmt(row["seconds"] / row["requests"] * 1e6, 0))
    settings = data["settings"]
    headers = ["variant", "ended by the disconnect", "RSS before MiB", "RSS growth MiB"]
    headers += ["RSS growth over the last 90% MiB", "live tasks after", "gc objects delta"]
    headers += ["objects left to the cyclic GC/request", "µs per cancelled request"]
    text = (
        f"**memory**: {settings['requests']:,} requests cancelled in process, "
        f"{settings['batch']:,} at a time\n\n" + table(headers, rows)
    )
    return text + "\n\n" + facts(data)


if __name__ == "__main__":  # the child: python -m benchmarks.memory VARIANT REQUESTS BATCH
    import uvloop

    variant, requests, batch = sys.argv[1:]
    sys.stdout.write(json.dumps(uvloop.run(child(variant, int(requests), int(batch)))) + "\n")
