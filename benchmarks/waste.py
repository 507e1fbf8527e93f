"""3. Wasted work under overload: a simulated continuous-batching engine behind uvicorn.

64 clients send `GET /generate` at once to a variant serving example_app's simulated engine
(fixed step time, bounded batch, FIFO queue: overloaded, as most requests wait). Half of them,
chosen by a seeded RNG, close their connection at a random moment; the others read their whole
response. Measured per variant, in the same run and with the same seed:

- wasted tokens: tokens the engine generated for a departed client after it left (the engine
  records a timestamp per token; the client records its close time; one clock);
- steps after the disconnect, per departed request (the bar: at most one);
- orphans: departed requests the engine never aborted (it ran them to the end for nobody);
- for the clients that stayed: latency p50/p99 and their token throughput.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time
import urllib.request
from typing import Any

from ._util import emit, fmt, have_py312, loadavg, machine, median, percentile, save, table
from .alternatives import VARIANTS
from .serve import Server, Servers, python_for

WASTE_VARIANTS = [
    "baseline",
    "asgi-cancel",
    "vllm",
    "poll-1s",
    "poll-0.1s",
    "poll-1s+bhm",
    "poll-0.1s+bhm",
    "streaming",
    "fastapi-disconnect",
]
QUICK_VARIANTS = {"baseline", "asgi-cancel", "vllm", "poll-0.1s", "streaming", "fastapi-disconnect"}
SERVER_CPU, CLIENT_CPU = 0, 1


async def client(
    port: int, request_id: int, tokens: int, leave_at: float | None, start: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    result: dict[str, Any] = {"id": request_id, "tokens": tokens, "leave_at": leave_at}
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        request = (
            f"GET /generate?id={request_id}&tokens={tokens} HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        await loop.sock_sendall(sock, request.encode())
        chunks: list[bytes] = []

        async def read_all() -> None:
            while True:
                data = await loop.sock_recv(sock, 65536)
                if not data:
                    return
                chunks.append(data)

        if leave_at is None:
            await read_all()
            result["ended"] = time.monotonic()
            response = b"".join(chunks)
            result["ok"] = response.startswith(b"HTTP/1.1 200")
        else:
            try:
                await asyncio.wait_for(read_all(), max(0.0, start + leave_at - time.monotonic()))
                result["ended"] = time.monotonic()  # finished before it meant to leave
                result["left"] = None
            except asyncio.TimeoutError:
                result["left"] = time.monotonic()
    finally:
        sock.close()
    return result


def http_get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.loads(response.read())


async def one_run(server: Server, plan: list[dict[str, Any]], settle: float) -> dict[str, Any]:
    http_get(server.port, "/reset")
    start = time.monotonic()
    clients = await asyncio.gather(
        *(client(server.port, item["id"], item["tokens"], item["leave_at"], start) for item in plan)
    )
    # Let the engine finish what it still runs (the baseline runs departed requests to the end).
    deadline = time.monotonic() + settle
    while True:
        stats = http_get(server.port, "/stats")
        if stats["unfinished"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    records = {record["id"]: record for record in stats["requests"]}
    wasted: list[int] = []
    orphans = aborted = 0
    stayer_latency: list[float] = []
    stayer_tokens = 0
    last_end = start
    failed = 0
    for entry in clients:
        record = records.get(str(entry["id"]))
        if entry.get("left") is not None:
            after = (
                sum(1 for stamp in record["token_times"] if stamp > entry["left"]) if record else 0
            )
            wasted.append(after)
            if record is not None:
                if record["aborted"] is not None:
                    aborted += 1
                elif record["finished"] is not None:
                    orphans += 1
        else:
            if not entry.get("ok", True):
                failed += 1
            stayer_latency.append(entry["ended"] - start)
            stayer_tokens += entry["tokens"]
            last_end = max(last_end, entry["ended"])
    return {
        "departed": len(wasted),
        "stayed": len(stayer_latency),
        "failed": failed,
        "wasted_tokens": sum(wasted),
        "wasted_steps_max": max(wasted, default=0),
        "wasted_steps_p50": median(wasted),
        "aborted": aborted,
        "orphans": orphans,
        "unfinished_after_settle": stats["unfinished"],
        "engine_steps": stats["steps"],
        "total_tokens": sum(len(r["token_times"]) for r in stats["requests"]),
        "stayer_p50_s": percentile(stayer_latency, 50),
        "stayer_p99_s": percentile(stayer_latency, 99),
        "stayer_tokens_per_s": stayer_tokens / max(1e-9, last_end - start),
        "makespan_s": last_end - start,
    }


def make_plan(
    seed: int, clients: int, tokens: tuple[int, int], leave_window: tuple[float, float]
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    leavers = set(rng.sample(range(clients), clients // 2))
    return [
        {
            "id": index,
            "tokens": rng.randint(*tokens),
            "leave_at": rng.uniform(*leave_window) if index in leavers else None,
        }
        for index in range(clients)
    ]


async def run_async(
    variants: list[str],
    repetitions: int,
    settings: dict[str, Any],
) -> dict[str, list[dict[str, Any]]]:
    servers = {
        variant: Server(
            "uvicorn",
            variant,
            "engine",
            python_for(VARIANTS[variant].python),
            cpu=SERVER_CPU,
            options={"step_time": settings["step_time"], "max_batch": settings["max_batch"]},
        )
        for variant in variants
    }
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    with Servers(list(servers.values())):
        for repetition in range(repetitions):
            plan = make_plan(
                1000 + repetition,
                settings["clients"],
                settings["tokens"],
                settings["leave_window"],
            )
            shift = repetition % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                runs[variant].append(await one_run(servers[variant], plan, settings["settle"]))
            emit(f"  repetition {repetition + 1}/{repetitions} done")
    return runs


def run(quick: bool) -> dict[str, Any]:
    variants = list(WASTE_VARIANTS)
    skipped: dict[str, str] = {}
    if not have_py312():
        variants.remove("fastapi-disconnect")
        skipped["fastapi-disconnect"] = "no Python 3.12 venv with fastapi-disconnect (see docs)"
    if quick:
        repetitions = 1
        variants = [v for v in variants if v in QUICK_VARIANTS]
        settings: dict[str, Any] = {
            "clients": 64,
            "step_time": 0.005,
            "max_batch": 16,
            "tokens": (10, 30),
            "leave_window": (0.02, 0.3),
            "settle": 10.0,
        }
    else:
        repetitions = 3
        settings = {
            "clients": 64,
            "step_time": 0.01,
            "max_batch": 16,
            "tokens": (50, 150),
            "leave_window": (0.05, 3.0),
            "settle": 30.0,
        }
    started = time.time()
    load_before = loadavg()
    emit("waste: simulated engine under uvicorn, 64 clients, half leave early")
    runs = asyncio.run(run_async(variants, repetitions, settings))
    summary: dict[str, dict[str, Any]] = {}
    for variant, these in runs.items():
        summary[variant] = {
            key: median(run[key] for run in these)
            for key in (
                "wasted_tokens",
                "wasted_steps_max",
                "orphans",
                "aborted",
                "departed",
                "stayer_p50_s",
                "stayer_p99_s",
                "stayer_tokens_per_s",
                "makespan_s",
                "total_tokens",
            )
        }
        summary[variant]["failed"] = sum(run["failed"] for run in these)
        summary[variant]["runs"] = these
    data = {
        "benchmark": "waste",
        "quick": quick,
        "command": " ".join(["python -m benchmarks waste", *(["--quick"] if quick else [])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
        "settings": {**settings, "repetitions": repetitions, "server": "uvicorn"},
        "variants": variants,
        "skipped": skipped,
        "summary": summary,
    }
    save("waste", data, quick=quick)
    emit(render(data))
    return data


def render(data: dict[str, Any]) -> str:
    rows = []
    base = data["summary"].get("baseline")
    for variant in data["variants"]:
        row = data["summary"][variant]
        throughput_ratio = (
            row["stayer_tokens_per_s"] / base["stayer_tokens_per_s"] if base else float("nan")
        )
        rows.append(
            [
                VARIANTS[variant].label,
                fmt(row["wasted_tokens"], 0),
                fmt(row["wasted_steps_max"], 0),
                f"{row['orphans']:.0f}/{row['departed']:.0f}",
                fmt(row["stayer_p50_s"], 2),
                fmt(row["stayer_p99_s"], 2),
                fmt(row["stayer_tokens_per_s"], 0),
                fmt(throughput_ratio, 2),
            ]
        )
    settings = data["settings"]
    header = (
        f"**wasted work**: {settings['clients']} clients, half leave early; engine step "
        f"{settings['step_time'] * 1e3:.0f} ms, batch {settings['max_batch']}; "
        f"medians of {settings['repetitions']} seeded runs\n\n"
    )
    return header + table(
        [
            "variant",
            "wasted tokens",
            "max steps after leaving",
            "orphans",
            "stayers p50 s",
            "stayers p99 s",
            "stayers tokens/s",
            "vs baseline",
        ],
        rows,
    )


if __name__ == "__main__":
    run("--quick" in sys.argv)
