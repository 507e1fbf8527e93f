"""3. Wasted work under overload: a simulated token generator behind uvicorn.

64 clients send `GET /generate` at once to a variant serving `alternatives.TokenGenerator`
(overloaded: most requests queue). Half of them (seeded) close their connection at a random
moment. Per variant, same seeds: the tokens made after a client left, the steps after it left
(the bar: one), orphans (requests that ran to the end for nobody: finished, with more than the
step in flight at the close made after it), and the stayers' latency and token throughput.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import urllib.request
from typing import Any

from ._util import emit, facts, fmt, median, percentile, table
from .alternatives import VARIANTS, runnable
from .serve import servers

WASTE_VARIANTS = [
    *("baseline", "asgi-cancel", "vllm", "poll-1s", "poll-0.1s", "poll-1s+bhm", "poll-0.1s+bhm"),
    *("streaming", "fastapi-disconnect"),
]
QUICK_VARIANTS = ["baseline", "asgi-cancel", "vllm", "poll-0.1s", "streaming", "fastapi-disconnect"]
FULL = {"clients": 64, "step_time": 0.01, "max_batch": 16, "tokens": (50, 150)}
FULL |= {"leave_window": (0.05, 3.0), "settle": 30.0, "repetitions": 3}
QUICK = FULL | {"step_time": 0.005, "tokens": (10, 30), "leave_window": (0.02, 0.3)}
QUICK |= {"settle": 10.0, "repetitions": 1}


async def client(port: int, plan: dict[str, Any], start: float) -> dict[str, Any]:
    """One request; the client leaves at `plan["leave_at"]` unless that is None."""
    loop = asyncio.get_running_loop()
    result: dict[str, Any] = {"left": None}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        path = f"/generate?id={plan['id']}&tokens={plan['tokens']}"
        request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        await loop.sock_sendall(sock, request.encode())
        response = bytearray()

        async def read_all() -> None:
            while data := await loop.sock_recv(sock, 65536):
                response.extend(data)

        leave = None if plan["leave_at"] is None else start + plan["leave_at"] - time.monotonic()
        try:
            await asyncio.wait_for(read_all(), None if leave is None else max(0.0, leave))
            result["ended"] = time.monotonic()  # also when it finished before it meant to leave
            result["ok"] = response.startswith(b"HTTP/1.1 200")
        except asyncio.TimeoutError:
            result["left"] = time.monotonic()
    return result


def http_get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.loads(response.read())


async def one_run(port: int, plans: list[dict[str, Any]], settle: float) -> dict[str, Any]:
    http_get(port, "/reset")
    start = time.monotonic()
    clients = await asyncio.gather(*(client(port, plan, start) for plan in plans))
    deadline = time.monotonic() + settle  # the baseline runs departed requests to the end
    while True:
        stats = http_get(port, "/stats")
        if not stats["unfinished"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    wasted: list[int] = []
    orphans = failed = 0
    latencies: list[float] = []
    stayer_tokens, last_end = 0, start
    for plan, entry in zip(plans, clients, strict=True):
        request = stats["requests"].get(str(plan["id"]), {"token_times": [], "end": None})
        if entry["left"] is not None:
            after = sum(1 for stamp in request["token_times"] if stamp > entry["left"])
            wasted.append(after)
            orphans += request["end"] == "finished" and after > 1
        else:
            failed += not entry["ok"]
            latencies.append(entry["ended"] - start)
            stayer_tokens += plan["tokens"]
            last_end = max(last_end, entry["ended"])
    result: dict[str, Any] = {"departed": len(wasted), "stayed": len(latencies), "failed": failed}
    result |= {"wasted_tokens": sum(wasted), "wasted_steps_max": max(wasted, default=0)}
    result |= {"orphans": orphans, "unfinished_after_settle": stats["unfinished"]}
    result |= {"stayer_p50_s": percentile(latencies, 50), "stayer_p99_s": percentile(latencies, 99)}
    return result | {"stayer_tokens_per_s": stayer_tokens / max(1e-9, last_end - start)}


def make_plans(seed: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    clients = settings["clients"]
    leavers, plans = set(rng.sample(range(clients), clients // 2)), []
    for index in range(clients):  # the draws in this order: the seeds give the same plans
        tokens = rng.randint(*settings["tokens"])
        leave_at = rng.uniform(*settings["leave_window"]) if index in leavers else None
        plans.append({"id": index, "tokens": tokens, "leave_at": leave_at})
    return plans


async def run_all(variants: list[str], settings: dict[str, Any]) -> dict[str, list[Any]]:
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    options = {"cpu": 0, "step_time": settings["step_time"], "max_batch": settings["max_batch"]}
    with servers("uvicorn", "engine", variants, **options) as started:
        for repetition in range(settings["repetitions"]):
            plans = make_plans(1000 + repetition, settings)
            shift = repetition % len(variants)  # no variant always runs first
            for variant in variants[shift:] + variants[:shift]:
                port = started[variant].port
                runs[variant].append(await one_run(port, plans, settings["settle"]))
            emit(f"  repetition {repetition + 1}/{settings['repetitions']} done")
    return runs


def run(quick: bool) -> dict[str, Any]:
    skipped: dict[str, str] = {}
    variants = runnable(QUICK_VARIANTS if quick else WASTE_VARIANTS, skipped)
    settings = QUICK if quick else FULL
    emit("waste: simulated token generator under uvicorn, 64 clients, half leave early")
    runs = asyncio.run(run_all(variants, settings))
    summary = {
        variant: {key: median(run[key] for run in these) for key in these[0]}
        | {"failed": sum(run["failed"] for run in these), "runs": these}
        for variant, these in runs.items()
    }
    settings = settings | {"server": "uvicorn"}
    return {"settings": settings, "variants": variants, "skipped": skipped, "summary": summary}


def check(data: dict[str, Any]) -> list[str]:
    """Nonsense: clients lost, answers failed, no waste without cancellation, or an orphan."""
    problems = []
    for variant, row in data["summary"].items():
        for run in row["runs"]:
            if run["departed"] + run["stayed"] != data["settings"]["clients"] or run["failed"]:
                problems.append(f"waste {variant}: {run}")
    baseline, ours = data["summary"]["baseline"], data["summary"]["asgi-cancel"]
    if baseline["departed"] and not baseline["wasted_tokens"]:
        problems.append(f"waste: no tokens wasted without cancellation: {baseline}")
    if ours["orphans"]:
        problems.append(f"waste: asgi-cancel left {ours['orphans']} requests running")
    return problems


def render(data: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    base = data["summary"].get("baseline", {}).get("stayer_tokens_per_s", float("nan"))
    for variant in data["variants"]:
        row = data["summary"][variant]
        rate, wasted = row["stayer_tokens_per_s"], fmt(row["wasted_tokens"], 0)
        rows.append([VARIANTS[variant], wasted, fmt(row["wasted_steps_max"], 0)])
        rows[-1] += [f"{row['orphans']:.0f}/{row['departed']:.0f}", fmt(row["stayer_p50_s"], 2)]
        rows[-1] += [fmt(row["stayer_p99_s"], 2), fmt(rate, 0), fmt(rate / base, 2)]
    settings = data["settings"]
    header = (
        f"**wasted work**: {settings['clients']} clients, half leave early; step "
        f"{settings['step_time'] * 1e3:.0f} ms, batch {settings['max_batch']}; "
        f"medians of {settings['repetitions']} seeded runs\n\n"
    )
    headers = ["variant", "wasted tokens", "max steps after leaving", "orphans"]
    headers += ["stayers p50 s", "stayers p99 s", "stayers tokens/s", "vs baseline"]
    return header + table(headers, rows) + "\n\n" + facts(data)
