"""1. Overhead: a hello world under real servers with wrk, and instructions per request.

Each variant is its own server process on CPU 0, wrk runs on CPU 1 at fixed concurrency. Runs
alternate (baseline, variant, baseline, next variant, ...), each ratio taken against the baseline
run just before it; the tables quote medians over the repetitions. Server CPU per request is the
server's utime+stime over the run / wrk's requests; each server counts its garbage collections (a
request kept alive shows there before CPU time does). Last, `benchmarks.instructions`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from . import instructions
from ._process import Process
from ._util import cpu_seconds, emit, facts, fmt, median, table
from .alternatives import VARIANTS, runnable
from .serve import SERVERS, servers

GROUPS = {  # each group's first variant is its baseline
    "fastapi": "baseline asgi-cancel passthrough vllm poll-1s poll-0.1s streaming".split(),
    "fastapi-py312": [
        *("baseline-py312", "asgi-cancel-py312"),
        *("fastapi-disconnect", "fastapi-disconnect-decorator"),
    ],
    "raw": ["raw-baseline", "raw-asgi-cancel", "raw-passthrough"],
}
LUA = Path(__file__).resolve().parent / "wrk_report.lua"
SERVER_CPU, CLIENT_CPU = 0, 1
# gen-0 collections per 1,000 requests that wrapping may cost (uvicorn, quick mode's check):
# a finished request kept alive by the middleware costs ~30, a do-nothing middleware ~0.
GC_ALLOWED = 3.0


def wrk(server: Process, seconds: int, connections: int = 32) -> dict[str, Any]:
    """wrk's summary (wrk_report.lua), and the server's CPU time per request over the run."""
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "5s"]
    command = ["taskset", "-c", str(CLIENT_CPU), *command] if shutil.which("taskset") else command
    command += ["-s", str(LUA), f"http://127.0.0.1:{server.port}/"]
    cpu = cpu_seconds(server.pid)
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30)
    match = re.search(r"^JSON (\{.*\})$", done.stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no summary:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(match.group(1))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    used = cpu_seconds(server.pid) - cpu
    result["cpu_us_per_request"] = used / max(1, result["requests"]) * 1e6
    return result


def run_server(
    server_name: str, groups: dict[str, list[str]], repetitions: int, seconds: int, warm_up: bool
) -> dict[str, Any]:
    """One server's table: every variant of `groups`, paired with its group's baseline."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for vs in groups.values() for v in vs}
    warm: dict[str, list[dict[str, Any]]] = {variant: [] for variant in runs}
    ratios: dict[str, dict[str, list[float]]] = {}
    with TemporaryDirectory(prefix="asgi-cancel-gc-") as folder:
        gc_files = {variant: Path(folder) / f"{variant}.gc" for variant in runs}
        with servers(server_name, "hello", runs, cpu=SERVER_CPU, gc_file=gc_files) as started:
            for variant, server in started.items() if warm_up else ():
                warm[variant].append(wrk(server, 1))  # caches, lazy imports
            for repetition in range(repetitions):
                for baseline, *others in groups.values():
                    for variant in others:
                        base, this = wrk(started[baseline], seconds), wrk(started[variant], seconds)
                        runs[baseline].append(base)
                        runs[variant].append(this)
                        pair = ratios.setdefault(variant, {"rps": [], "cpu": [], "p99": []})
                        pair["rps"].append(this["rps"] / base["rps"])
                        pair["cpu"].append(this["cpu_us_per_request"] / base["cpu_us_per_request"])
                        pair["p99"].append(this["p99_us"] / max(1, base["p99_us"]))
                emit(f"  {server_name}: repetition {repetition + 1}/{repetitions} done")
        collections = {
            v: [int(n) for n in path.read_text().split()] for v, path in gc_files.items()
        }
    summary: dict[str, Any] = {}
    for variant, these in runs.items():
        served = sum(run["requests"] for run in these + warm[variant])
        cell: dict[str, Any] = {
            k: median(run[k] for run in these) for k in ("rps", "cpu_us_per_request")
        }
        cell["p99_ms"] = median(run["p99_us"] for run in these) / 1e3
        cell["errors"] = sum(run["errors"] + run["status_errors"] for run in these + warm[variant])
        cell["gc_per_1000"] = [count * 1000 / max(1, served) for count in collections[variant]]
        summary[variant] = cell | {"requests": served, "ratios": ratios.get(variant, {})}
    return summary


def run(quick: bool) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("overhead: wrk is not installed (apt-get install wrk)")
    skipped: dict[str, str] = {}
    groups = {name: runnable(vs[:2] if quick else vs, skipped) for name, vs in GROUPS.items()}
    groups = {name: variants for name, variants in groups.items() if variants}  # quick: 2 each
    repetitions, seconds = (1, 1) if quick else (5, 3)
    emit("overhead: wrk against uvicorn and hypercorn")
    results = {
        name: run_server(name, groups, repetitions, seconds, warm_up=not quick) for name in SERVERS
    }
    counts: dict[str, Any] = {}
    if shutil.which("valgrind") is None:
        skipped["instructions"] = "valgrind is not installed"
    else:
        emit("overhead: instructions per request inside uvicorn (callgrind)")
        counts = instructions.run(requests=300 if quick else instructions.REQUESTS)
    settings = {"repetitions": repetitions, "seconds_per_run": seconds, "connections": 32}
    data = {"settings": settings, "groups": groups, "skipped": skipped, "servers": results}
    return data | {"instructions": counts}


def check(data: dict[str, Any]) -> list[str]:
    """What makes a quick run nonsense: no requests, errors, extra collections, odd counts."""
    problems = [
        f"overhead {server_name}/{variant}: {row['requests']} requests, {row['errors']} errors"
        for server_name, summary in data["servers"].items()
        for variant, row in summary.items()
        if row["requests"] < 100 or row["errors"]
    ]
    uvicorn = data["servers"]["uvicorn"]
    for bare, wrapped in (("baseline", "asgi-cancel"), ("raw-baseline", "raw-asgi-cancel")):
        counts = uvicorn[bare]["gc_per_1000"][0], uvicorn[wrapped]["gc_per_1000"][0]
        if counts[1] > max(GC_ALLOWED, 3 * counts[0]):  # it keeps requests' objects alive
            problems.append(f"overhead: gen-0 collections/1,000 requests {bare} {wrapped} {counts}")
    for row, counts in data["instructions"].items():
        if not 0 < counts["bare"] < counts["asgi-cancel"] < 3 * counts["bare"]:
            problems.append(f"overhead: instructions per request, {row}: {counts}")
    return problems


def _ratio(row: dict[str, Any], key: str, spread: bool = True) -> str:
    """The median of the paired ratios, and their range over the repetitions."""
    values = row["ratios"].get(key)
    if not values:
        return "(baseline)"
    return f"x{median(values):.3f}" + (f" ({min(values):.2f}-{max(values):.2f})" if spread else "")


def render(data: dict[str, Any]) -> str:
    names = [name for name in SERVERS if name in data["servers"]]
    rows = []
    for variant in (variant for variants in data["groups"].values() for variant in variants):
        row = [VARIANTS[variant]]
        for name in names:
            cell = data["servers"][name][variant]
            errors = f" ({cell['errors']} errors)" if cell["errors"] else ""
            row.append(fmt(cell["rps"], 0) + errors)
            row.append(f"{fmt(cell['cpu_us_per_request'], 1)} {_ratio(cell, 'cpu')}")
            row.append(f"{fmt(cell['p99_ms'], 1)} {_ratio(cell, 'p99', spread=False)}")
            row.append(fmt(cell["gc_per_1000"][0], 1))  # gen-0
        rows.append(row)
    columns = ("req/s", "CPU µs/req (ratio, range)", "p99 ms (ratio)", "gen-0 GCs/1k req")
    headers = ["variant", *(f"{name} {column}" for name in names for column in columns)]
    parts = ["**hello world**, `wrk -c32`, medians\n", table(headers, rows), ""]
    if data["instructions"]:
        parts += ["**inside uvicorn**, bare ASGI apps, `python -m benchmarks.instructions`\n"]
        parts.append(instructions.render(data["instructions"]))
    return "\n".join(parts) + "\n\n" + facts(data)
