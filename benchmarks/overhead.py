"""1. Overhead: a hello-world JSON endpoint under real servers with wrk, plus in-process costs.

For each server, every variant runs as its own server process pinned to CPU 0 (they idle until
measured) and wrk runs pinned to CPU 1 at fixed concurrency. Runs alternate: baseline, variant,
baseline, next variant, ... and each variant's ratio is taken against the baseline run right
before it, in the same interpreter group (3.11: the dev venv; 3.12: fastapi-disconnect's venv;
bare ASGI). The ratios' medians over the repetitions are what the tables quote. Server CPU per
request is the server process's utime+stime delta over the run divided by wrk's request count.
Instructions per request (callgrind, deterministic): every variant in process, and the bare ASGI
app that never awaits and one that awaits 1 ms inside uvicorn (`benchmarks.instructions`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._callgrind import available as callgrind_available
from ._callgrind import run_callgrind
from ._util import (
    ROOT,
    emit,
    fmt,
    have_py312,
    loadavg,
    machine,
    median,
    save,
    table,
)
from .alternatives import VARIANTS
from .instructions import render as render_instructions
from .instructions import run as instructions_in_uvicorn
from .serve import SERVERS, Server, Servers, python_for

GROUPS: dict[str, list[str]] = {
    "fastapi": [
        "baseline",
        "asgi-cancel",
        "passthrough",
        "vllm",
        "poll-1s",
        "poll-0.1s",
        "streaming",
    ],
    "fastapi-py312": [
        "baseline-py312",
        "asgi-cancel-py312",
        "fastapi-disconnect",
        "fastapi-disconnect-decorator",
    ],
    "raw": ["raw-baseline", "raw-asgi-cancel", "raw-passthrough"],
}
LUA = Path(__file__).resolve().parent / "wrk_report.lua"
SERVER_CPU, CLIENT_CPU = 0, 1
CALLGRIND_REQUESTS = 500


def wrk(port: int, seconds: int, connections: int) -> dict[str, Any]:
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, seconds)}s",
        "--timeout",
        "5s",
        "-s",
        str(LUA),
        f"http://127.0.0.1:{port}/",
    ]
    if shutil.which("taskset"):
        command = ["taskset", "-c", str(CLIENT_CPU), *command]
    output = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=seconds + 30
    ).stdout
    match = re.search(r"^JSON (\{.*\})$", output, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no summary:\n{output}")
    result: dict[str, Any] = json.loads(match.group(1))
    return result


def measure(server: Server, seconds: int, connections: int) -> dict[str, Any]:
    cpu0, ns0, load0 = server.cpu_seconds(), server.cpu_ns(), loadavg()[0]
    result = wrk(server.port, seconds, connections)
    cpu1, ns1 = server.cpu_seconds(), server.cpu_ns()
    requests = max(1, result["requests"])
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    result["cpu_us_per_request"] = (cpu1 - cpu0) / requests * 1e6
    result["sched_us_per_request"] = (ns1 - ns0) / requests / 1e3
    result["load1"] = load0
    return result


def run_servers(
    groups: dict[str, list[str]],
    repetitions: int,
    seconds: int,
    connections: int,
    warm_up: bool = True,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for server_name in SERVERS:
        servers = {
            (group, variant): Server(
                server_name,
                variant,
                "hello",
                python_for(VARIANTS[variant].python),
                cpu=SERVER_CPU,
            )
            for group, variants in groups.items()
            for variant in variants
        }
        runs: dict[str, list[dict[str, Any]]] = {variant: [] for _g, variant in servers}
        pairs: dict[str, list[dict[str, float]]] = {}
        with Servers(list(servers.values())):
            for server in servers.values() if warm_up else ():
                wrk(server.port, 1, connections)  # warm up: caches, pools, lazy imports
            for repetition in range(repetitions):
                for group, variants in groups.items():
                    baseline, *others = variants
                    for variant in others:
                        base = measure(servers[group, baseline], seconds, connections)
                        this = measure(servers[group, variant], seconds, connections)
                        runs[baseline].append(base)
                        runs[variant].append(this)
                        pairs.setdefault(variant, []).append(
                            {
                                "rps": this["rps"] / base["rps"],
                                "cpu": this["cpu_us_per_request"] / base["cpu_us_per_request"],
                                "sched": this["sched_us_per_request"]
                                / base["sched_us_per_request"],
                                "p99": this["p99_us"] / max(1, base["p99_us"]),
                            }
                        )
                emit(f"  {server_name}: repetition {repetition + 1}/{repetitions} done")
        summary: dict[str, Any] = {}
        for group, variants in groups.items():
            for variant in variants:
                these = runs[variant]
                summary[variant] = {
                    "group": group,
                    "baseline": variants[0],
                    "rps": median(run["rps"] for run in these),
                    "p99_ms": median(run["p99_us"] for run in these) / 1e3,
                    "cpu_us_per_request": median(run["cpu_us_per_request"] for run in these),
                    "sched_us_per_request": median(run["sched_us_per_request"] for run in these),
                    "errors": sum(run["errors"] + run["status_errors"] for run in these),
                    "runs": these,
                }
                if variant in pairs:
                    ratios = pairs[variant]
                    summary[variant]["ratios"] = ratios
                    for key in ("rps", "cpu", "sched", "p99"):
                        summary[variant][f"{key}_ratio"] = median(r[key] for r in ratios)
        out[server_name] = summary
    return out


def run_inproc(
    groups: dict[str, list[str]], requests: int, rounds: int, quick: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, variants in groups.items():
        python = python_for(VARIANTS[variants[0]].python)
        result = subprocess.run(
            [python, "-m", "benchmarks._inproc", "micro", *variants]
            + ["--requests", str(requests), "--rounds", str(rounds)]
            + (["--quick"] if quick else []),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        data = json.loads(result.stdout)
        base = data["variants"][variants[0]]
        for variant in variants:
            row = data["variants"][variant]
            row["group"] = group
            row["baseline"] = variants[0]
            # Added cost per round, paired with the same round's baseline, then the median.
            row["us_added"] = median(
                t - b for t, b in zip(row["us_per_request"], base["us_per_request"], strict=True)
            )
            row["ratio"] = median(
                t / b for t, b in zip(row["us_per_request"], base["us_per_request"], strict=True)
            )
            row["peak_alloc_added"] = row["peak_alloc_bytes"] - base["peak_alloc_bytes"]
            out[variant] = row
    return out


def run(quick: bool) -> dict[str, Any]:
    groups = dict(GROUPS)
    skipped: dict[str, str] = {}
    if not have_py312():
        skipped["fastapi-py312"] = "no Python 3.12 venv with fastapi-disconnect (see docs)"
        groups.pop("fastapi-py312")
    server_groups = groups
    if quick:  # proves that everything runs; a subset of the variants under the servers
        repetitions, seconds, connections = 1, 1, 32
        requests, rounds = 100, 2
        server_groups = {group: variants[:2] for group, variants in groups.items()}
        if "fastapi-py312" in server_groups:
            server_groups["fastapi-py312"] = ["baseline-py312", "fastapi-disconnect"]
    else:
        repetitions, seconds, connections = 5, 3, 32
        requests, rounds = 2000, 9
    started = time.time()
    load_before = loadavg()
    emit("overhead: in-process microbenchmark")
    inproc = run_inproc(groups, requests, rounds, quick)
    instructions: dict[str, Any] = {}
    uvicorn_instructions: dict[str, Any] = {}
    if quick:
        skipped["callgrind"] = "left out of --quick"
    elif not callgrind_available():
        skipped["callgrind"] = "valgrind is not installed"
    else:
        emit("overhead: instructions per request under callgrind")
        instructions = run_callgrind(
            {
                group: (python_for(VARIANTS[variants[0]].python), variants)
                for group, variants in groups.items()
            },
            CALLGRIND_REQUESTS,
        )
        emit("overhead: instructions per request inside uvicorn under callgrind")
        uvicorn_instructions = instructions_in_uvicorn()
    servers: dict[str, Any] = {}
    if shutil.which("wrk") is None:
        skipped["servers"] = "wrk is not installed (apt-get install wrk)"
    else:
        emit("overhead: wrk against uvicorn and hypercorn")
        servers = run_servers(server_groups, repetitions, seconds, connections, warm_up=not quick)
    data = {
        "benchmark": "overhead",
        "quick": quick,
        "command": " ".join(["python -m benchmarks overhead", *(["--quick"] if quick else [])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
        "settings": {
            "repetitions": repetitions,
            "seconds_per_run": seconds,
            "connections": connections,
            "inproc_requests": requests,
            "inproc_rounds": rounds,
            "server_cpu": SERVER_CPU,
            "client_cpu": CLIENT_CPU,
        },
        "groups": groups,
        "server_groups": server_groups,
        "skipped": skipped,
        "inproc": inproc,
        "instructions": instructions,
        "uvicorn_instructions": uvicorn_instructions,
        "servers": servers,
    }
    save("overhead", data, quick=quick)
    emit(render(data))
    return data


def render(data: dict[str, Any]) -> str:
    parts: list[str] = []
    order = [variant for variants in data["server_groups"].values() for variant in variants]
    for server_name in [name for name in SERVERS if name in data["servers"]]:
        summary = data["servers"][server_name]
        rows = []
        for variant in order:
            row = summary[variant]
            is_base = variant == row["baseline"]
            rows.append(
                [
                    VARIANTS[variant].label,
                    fmt(row["rps"], 0),
                    "1 (baseline)" if is_base else _spread(row, "rps"),
                    fmt(row["cpu_us_per_request"], 1),
                    "1 (baseline)" if is_base else _spread(row, "cpu"),
                    fmt(row["p99_ms"], 1),
                    "1 (baseline)" if is_base else fmt(row.get("p99_ratio"), 2),
                    row["errors"],
                ]
            )
        parts.append(f"**{server_name}**, hello-world JSON, wrk, medians\n")
        parts.append(
            table(
                [
                    "variant",
                    "req/s",
                    "req/s ratio (min-max)",
                    "server CPU µs/req",
                    "CPU/req ratio (min-max)",
                    "p99 ms",
                    "p99 ratio",
                    "errors",
                ],
                rows,
            )
        )
        parts.append("")
    rows = []
    for variant in [variant for variants in data["groups"].values() for variant in variants]:
        row = data["inproc"][variant]
        is_base = variant == row["baseline"]
        rows.append(
            [
                VARIANTS[variant].label,
                fmt(row["us_median"], 2),
                "0 (baseline)" if is_base else fmt(row["us_added"], 2),
                "1 (baseline)" if is_base else fmt(row["ratio"], 3),
                fmt(row["tasks_per_request"], 2),
                fmt(row["peak_alloc_bytes"], 0),
                fmt(row.get("cyclic_garbage_per_request"), 1),
                _instructions(data, variant),
            ]
        )
    parts.append("**in-process** (ASGI level, uvloop, no sockets), medians\n")
    parts.append(
        table(
            [
                "variant",
                "µs/request",
                "µs added",
                "ratio",
                "tasks created/request",
                "peak bytes/request",
                "objects left to the cyclic GC/request",
                "instructions/request (callgrind)",
            ],
            rows,
        )
    )
    if data.get("uvicorn_instructions"):
        parts.append(
            "\n**inside uvicorn** (httptools, uvloop; `python -m benchmarks.instructions`), "
            "bare ASGI apps, 2,000 keep-alive requests\n"
        )
        parts.append(render_instructions(data["uvicorn_instructions"]))
    for name, why in data.get("skipped", {}).items():
        parts.append(f"\nskipped {name}: {why}")
    return "\n".join(parts)


def _spread(row: dict[str, Any], key: str) -> str:
    """The median of the paired ratios, and their range over the repetitions."""
    ratios = [pair[key] for pair in row.get("ratios", [])]
    if not ratios:
        return "n/a"
    return f"{row[key + '_ratio']:.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _instructions(data: dict[str, Any], variant: str) -> str:
    row = data.get("instructions", {}).get(variant)
    if row is None:
        return "n/a"
    text = f"{row['instructions_per_request'] / 1e3:,.1f} k"
    if "ratio" in row:
        text += f" (x{row['ratio']:.3f})"
    return text


if __name__ == "__main__":
    run("--quick" in sys.argv)
