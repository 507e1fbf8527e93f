"""2. Cancel latency: from the client's close (FIN or RST) to the app's `CancelledError`.

Each variant serves `GET /slow?id=N`, which holds for `hold` seconds and appends a timestamped
line to an events file the moment its work is cancelled (`time.monotonic()`: one clock for all
processes on Linux). A client connects, sends the request, waits a random 100 ms to 1.1 s
(seeded; a full polling period, so that polling is measured at every phase) and closes, either
gracefully (FIN) or with `SO_LINGER 0` (RST). Latency = cancellation time - close time.
All variants run in each batch at once, with the same delays, each on its own server process
(all pinned to CPU 0), so that a stall of the shared machine hits every column alike.
"never" means the work ran to its end although the client had gone.

`floor` is a bare ASGI app waiting in `receive()` for `http.disconnect`: the server's own
delivery, the lower bound for any middleware.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._util import (
    emit,
    fmt,
    have_py312,
    loadavg,
    machine,
    percentile,
    save,
    table,
)
from .alternatives import VARIANTS
from .serve import SERVERS, Server, Servers, python_for

LATENCY_VARIANTS = [
    "floor",
    "asgi-cancel",
    "vllm",
    "poll-1s",
    "poll-0.1s",
    "poll-1s+bhm",
    "poll-0.1s+bhm",
    "streaming",
    "fastapi-disconnect",
    "fastapi-disconnect-decorator",
]
QUICK_VARIANTS = {
    "floor",
    "asgi-cancel",
    "vllm",
    "poll-0.1s",
    "poll-0.1s+bhm",
    "streaming",
    "fastapi-disconnect",
}
CLOSES = ("fin", "rst")
MIN_DELAY = 0.1  # after the request: the app has started its work (see not_started)
SERVER_CPU, CLIENT_CPU = 0, 1


class Events:
    """Reads the events file that a server appends to, incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.seen: dict[int, dict[str, float]] = {}

    def poll(self) -> None:
        with self.path.open("rb") as file:
            file.seek(self.offset)
            data = file.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            request_id, event, stamp = line.split()
            self.seen.setdefault(int(request_id), {})[event.decode()] = float(stamp)

    def ended(self, request_id: int) -> bool:
        events = self.seen.get(request_id, {})
        return "cancelled" in events or "completed" in events


async def client(port: int, request_id: int, delay: float, close: str) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        request = f"GET /slow?id={request_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        await loop.sock_sendall(sock, request)
        await asyncio.sleep(delay)
        if close == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        closed_at = time.monotonic()
    finally:
        sock.close()
    return {"id": request_id, "closed": closed_at, "delay": delay}


async def batch(
    server: Server,
    events: Events,
    first_id: int,
    size: int,
    close: str,
    rng: random.Random,
    max_delay: float,
    hold: float,
) -> list[dict[str, Any]]:
    delays = [rng.uniform(MIN_DELAY, max_delay) for _ in range(size)]
    started = time.monotonic()
    closes = await asyncio.gather(
        *(client(server.port, first_id + i, delay, close) for i, delay in enumerate(delays))
    )
    deadline = started + hold + 1.0
    while True:  # until every request's work has ended one way or the other
        events.poll()
        if all(events.ended(c["id"]) for c in closes) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    samples = []
    for entry in closes:
        seen = events.seen.get(entry["id"], {})
        sample: dict[str, Any] = {"delay": entry["delay"], "started": "start" in seen}
        if "cancelled" in seen:
            sample["latency_ms"] = (seen["cancelled"] - entry["closed"]) * 1e3
        else:
            sample["latency_ms"] = None  # never cancelled: ran to the end, or still running
        samples.append(sample)
    return samples


async def run_async(
    variants: list[str], samples: int, per_batch: int, max_delay: float, hold: float, seed: int
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    next_id = 0
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-latency-") as folder:
        for server_name in SERVERS:
            servers = {
                variant: Server(
                    server_name,
                    variant,
                    "slow",
                    python_for(VARIANTS[variant].python),
                    cpu=SERVER_CPU,
                    options={"hold": hold},
                )
                for variant in variants
            }
            files = {}
            for variant, server in servers.items():
                path = Path(folder) / f"{server_name}-{variant}.events"
                path.touch()
                server.events = path
                files[variant] = Events(path)
            cells: dict[str, dict[str, list[dict[str, Any]]]] = {
                close: {variant: [] for variant in variants} for close in CLOSES
            }
            with Servers(list(servers.values())):
                rounds = max(1, samples // per_batch)
                for round_number in range(rounds):
                    for close in CLOSES:
                        # Every variant at once, with the same close delays: a hiccup of the
                        # machine (other jobs share it) hits all columns alike.
                        firsts = {}
                        for variant in variants:
                            firsts[variant] = next_id
                            next_id += per_batch
                        results_by_variant = await asyncio.gather(
                            *(
                                batch(
                                    servers[variant],
                                    files[variant],
                                    firsts[variant],
                                    per_batch,
                                    close,
                                    random.Random(f"{seed}-{round_number}-{close}"),
                                    max_delay,
                                    hold,
                                )
                                for variant in variants
                            )
                        )
                        for variant, found in zip(variants, results_by_variant, strict=True):
                            cells[close][variant] += found
                    emit(f"  {server_name}: round {round_number + 1}/{rounds} done")
            results[server_name] = {
                close: {variant: summarize(cells[close][variant]) for variant in variants}
                for close in CLOSES
            }
    return results


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    # A request whose work never started is left out: with RST the kernel drops request bytes
    # the server had not read yet, so a server that lags behind the close never sees it.
    started = [s for s in samples if s["started"]]
    latencies = [s["latency_ms"] for s in started if s["latency_ms"] is not None]
    return {
        "n": len(started),
        "cancelled": len(latencies),
        "never": len(started) - len(latencies),
        "not_started": len(samples) - len(started),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else float("nan"),
        "latencies_ms": sorted(latencies),
    }


def run(quick: bool) -> dict[str, Any]:
    variants = list(LATENCY_VARIANTS)
    skipped: dict[str, str] = {}
    if not have_py312():
        for name in ("fastapi-disconnect", "fastapi-disconnect-decorator"):
            variants.remove(name)
            skipped[name] = "no Python 3.12 venv with fastapi-disconnect (see docs)"
    if quick:
        samples, per_batch, max_delay, hold = 3, 3, 0.2, 0.6
        variants = [v for v in variants if v in QUICK_VARIANTS]
    else:
        samples, per_batch, max_delay, hold = 120, 20, 1.1, 3.0
    started = time.time()
    load_before = loadavg()
    emit("latency: close -> CancelledError, uvicorn and hypercorn")
    results = asyncio.run(run_async(variants, samples, per_batch, max_delay, hold, seed=2024))
    data = {
        "benchmark": "latency",
        "quick": quick,
        "command": " ".join(["python -m benchmarks latency", *(["--quick"] if quick else [])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
        "settings": {
            "samples": samples,
            "per_batch": per_batch,
            "close_delay_s": [MIN_DELAY, max_delay],
            "hold_s": hold,
        },
        "variants": variants,
        "skipped": skipped,
        "results": results,
    }
    save("latency", data, quick=quick)
    emit(render(data))
    return data


def render(data: dict[str, Any]) -> str:
    parts = []
    for server_name, by_close in data["results"].items():
        rows = []
        for variant in data["variants"]:
            cells = [VARIANTS[variant].label]
            for close in CLOSES:
                cell = by_close[close][variant]
                if cell["cancelled"] == 0:
                    cells += [f"never ({cell['never']}/{cell['n']})", "never"]
                else:
                    never = f" ({cell['never']} never)" if cell["never"] else ""
                    if cell["not_started"]:
                        never += f" ({cell['not_started']} not started)"
                    cells += [fmt(cell["p50_ms"], 2) + never, fmt(cell["p99_ms"], 2)]
            floor = by_close["fin"].get("floor")
            fin = by_close["fin"][variant]
            if floor and fin["cancelled"] and variant != "floor":
                cells.append(fmt(fin["p50_ms"] - floor["p50_ms"], 2))
            else:
                cells.append("-")
            rows.append(cells)
        parts.append(f"**{server_name}**: close → app's CancelledError, ms\n")
        parts.append(
            table(
                ["variant", "FIN p50", "FIN p99", "RST p50", "RST p99", "FIN p50 minus floor"],
                rows,
            )
        )
        parts.append("")
    for name, why in data.get("skipped", {}).items():
        parts.append(f"skipped {name}: {why}")
    return "\n".join(parts)


if __name__ == "__main__":
    run("--quick" in sys.argv)
