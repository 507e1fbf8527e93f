"""2. Cancel latency: from the client's close (FIN or RST) to the app's `CancelledError`.

`GET /slow?id=N` holds `hold` seconds and logs when its work is cancelled (`time.monotonic()`:
one clock for all processes). A client sends it, waits a seeded random 0.1-1.1 s (a full polling
period) and closes, with FIN or with `SO_LINGER 0` (RST). Every variant, each its own server on
CPU 0, runs in each batch at once with the same delays: a stall of the machine hits them alike.
"never": the work ran to its end although the client had gone.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from ._util import emit, facts, fmt, percentile, table
from .alternatives import VARIANTS, runnable
from .serve import SERVERS, servers

LATENCY_VARIANTS = [
    *("floor", "asgi-cancel", "vllm", "poll-1s", "poll-0.1s", "poll-1s+bhm", "poll-0.1s+bhm"),
    *("streaming", "fastapi-disconnect", "fastapi-disconnect-decorator"),
]
QUICK_VARIANTS = "floor asgi-cancel vllm poll-0.1s poll-0.1s+bhm streaming fastapi-disconnect"
CLOSES = ("fin", "rst")
MIN_DELAY = 0.1  # after the request: the app has started its work


def read_events(path: Path) -> dict[int, dict[str, float]]:
    seen: dict[int, dict[str, float]] = {}
    data = path.read_bytes()
    for line in data[: data.rfind(b"\n") + 1].splitlines():  # whole lines only
        request_id, event, stamp = line.split()
        seen.setdefault(int(request_id), {})[event.decode()] = float(stamp)
    return seen


async def client(port: int, request_id: int, delay: float, close: str) -> float:
    """Send the request, wait `delay`, close; return the close's time."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        request = f"GET /slow?id={request_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        await loop.sock_sendall(sock, request.encode())
        await asyncio.sleep(delay)
        if close == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return time.monotonic()


async def batch(
    port: int, events: Path, ids: range, close: str, delays: list[float], hold: float
) -> list[tuple[bool, float | None]]:
    closed = await asyncio.gather(
        *(client(port, request_id, d, close) for request_id, d in zip(ids, delays, strict=True))
    )
    deadline = time.monotonic() + hold + 1.0
    while True:  # until every request's work has ended, one way or the other
        seen = read_events(events)
        ended = [seen.get(i, {}).keys() & {"cancelled", "completed"} for i in ids]
        if all(ended) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    # A sample: did the work start, and the ms from the close to its cancellation (or None).
    events_of = [seen.get(request_id, {}) for request_id in ids]
    return [
        ("start" in got, (got["cancelled"] - at) * 1e3 if "cancelled" in got else None)
        for got, at in zip(events_of, closed, strict=True)
    ]


async def run_server(
    server_name: str, variants: list[str], settings: dict[str, Any], folder: Path
) -> dict[str, Any]:
    per_batch, hold = settings["per_batch"], settings["hold_s"]
    events = {variant: Path(folder) / f"{server_name}-{variant}.events" for variant in variants}
    cells: dict[str, dict[str, list[Any]]] = {c: {v: [] for v in variants} for c in CLOSES}
    next_id = 0
    with servers(server_name, "slow", variants, cpu=0, hold=hold, events=events) as started:
        for path in events.values():
            path.touch()
        rounds = max(1, settings["samples"] // per_batch)
        for round_number in range(rounds):
            for close in CLOSES:
                rng = random.Random(f"{settings['seed']}-{round_number}-{close}")
                delays = [rng.uniform(MIN_DELAY, settings["max_delay_s"]) for _ in range(per_batch)]
                jobs = []
                for variant in variants:  # every variant at once: a stall hits them alike
                    ids = range(next_id, next_id + per_batch)
                    next_id += per_batch
                    port = started[variant].port
                    jobs.append(batch(port, events[variant], ids, close, delays, hold))
                for variant, samples in zip(variants, await asyncio.gather(*jobs), strict=True):
                    cells[close][variant] += samples
            emit(f"  {server_name}: round {round_number + 1}/{rounds} done")
    return {close: {v: summarize(cells[close][v]) for v in variants} for close in CLOSES}


def summarize(samples: list[tuple[bool, float | None]]) -> dict[str, Any]:
    # A request whose work never started is left out: with RST the kernel drops request bytes
    # the server had not read yet, so a server that lags behind the close never sees it.
    started = [latency for began, latency in samples if began]
    latencies = sorted(latency for latency in started if latency is not None)
    counts = {"n": len(started), "cancelled": len(latencies), "latencies_ms": latencies}
    counts |= {"never": len(started) - len(latencies), "not_started": len(samples) - len(started)}
    return counts | {"p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


def run(quick: bool) -> dict[str, Any]:
    skipped: dict[str, str] = {}
    variants = runnable(QUICK_VARIANTS.split() if quick else LATENCY_VARIANTS, skipped)
    settings: dict[str, Any] = {"samples": 120, "per_batch": 20, "max_delay_s": 1.1, "hold_s": 3.0}
    if quick:
        settings = {"samples": 3, "per_batch": 3, "max_delay_s": 0.2, "hold_s": 0.6}
    settings |= {"min_delay_s": MIN_DELAY, "seed": 2024}
    emit("latency: close -> CancelledError, uvicorn and hypercorn")
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-latency-") as folder:
        results = {
            name: asyncio.run(run_server(name, variants, settings, Path(folder)))
            for name in SERVERS
        }
    return {"settings": settings, "variants": variants, "skipped": skipped, "results": results}


def check(data: dict[str, Any]) -> list[str]:
    """Nonsense: no sample of the floor, or asgi-cancel leaving a request uncancelled."""
    problems = []
    for server_name, by_close in data["results"].items():
        for close, cells in by_close.items():
            floor, ours = cells["floor"], cells["asgi-cancel"]
            if floor["cancelled"] == 0 or ours["n"] == 0 or ours["never"]:
                problems.append(f"latency {server_name}/{close}: floor {floor}, asgi-cancel {ours}")
    return problems


def render(data: dict[str, Any]) -> str:
    names = [name for name in SERVERS if name in data["results"]]
    rows = []
    for variant in data["variants"]:
        row = [VARIANTS[variant]]
        for cell in (data["results"][name][close][variant] for name in names for close in CLOSES):
            notes = f" ({cell['never']} never)" if cell["never"] else ""
            notes += f" ({cell['not_started']} not started)" if cell["not_started"] else ""
            ms = f"{fmt(cell['p50_ms'], 2)} / {fmt(cell['p99_ms'], 2)}{notes}"
            row.append(ms if cell["cancelled"] else f"never ({cell['never']}/{cell['n']})")
        rows.append(row)
    headers = ["variant", *(f"{name} {c.upper()} p50 / p99" for name in names for c in CLOSES)]
    title = "**close → the app's CancelledError**, ms\n\n"
    return title + table(headers, rows) + "\n\n" + facts(data)
