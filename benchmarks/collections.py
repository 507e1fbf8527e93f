"""Garbage-collector runs per 1,000 requests inside uvicorn under keep-alive load.

`python -m benchmarks.collections` serves the FastAPI hello world of `benchmarks overhead`
(and its bare ASGI app) under uvicorn (httptools, uvloop), bare, with asgi-cancel and with a
do-nothing middleware, drives each with `wrk -t1 -c32` for a few seconds, and counts the
collections of each generation in the server (`gc.callbacks`). A middleware that keeps a
request's objects alive past the request (in a context a server copied, in a reference cycle)
shows here as generation-0 collections, long before it shows in CPU time: that is how the
finished cycle holding uvicorn's `send` (10x the collections) was found. Counts, not times: a
loaded machine changes how many requests are sent, not how many collections each one costs.

Child side: `python -m benchmarks.collections serve VARIANT PORT OUT`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from example_app.launch import Subprocess, listening

from ._util import ROOT, emit, table

VARIANTS = (
    "baseline",
    "asgi-cancel",
    "passthrough",
    "vllm",
    "raw-baseline",
    "raw-asgi-cancel",
    "raw-passthrough",
)
SECONDS = 4
CONNECTIONS = 32


def serve(variant: str, port: int, out: str) -> None:
    """The child: count collections by generation, write them at exit (`gen0 gen1 gen2`)."""
    import atexit
    import gc

    import uvicorn

    from .alternatives import build

    counts = [0, 0, 0]

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    def write() -> None:
        Path(out).write_text(" ".join(map(str, counts)))

    app = build(variant, "hello", hold=3.0)
    gc.collect()
    gc.callbacks.append(count)
    atexit.register(write)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


def measure(variant: str, seconds: float, folder: Path) -> dict[str, float]:
    """Requests served and collections per 1,000 requests for one variant."""
    out = folder / f"{variant}.txt"
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []

    def argv(port: int) -> list[str]:
        child = ["-m", "benchmarks.collections", "serve", variant, str(port), str(out)]
        return [*pin, sys.executable, *child]

    server = Subprocess(
        argv, ready=listening, cwd=ROOT, stop_signal=signal.SIGINT, stop_timeout=10.0
    )
    with server:
        url = f"http://127.0.0.1:{server.port}/"
        wrk = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s", url]
        if pin:
            wrk = ["taskset", "-c", "1", *wrk]
        output = subprocess.run(wrk, capture_output=True, text=True, timeout=seconds + 60).stdout
    counted = [int(line.split()[0]) for line in output.splitlines() if "requests in" in line]
    if not counted:
        raise RuntimeError(f"wrk reported no requests for {variant}:\n{output[-2000:]}")
    requests = counted[0]
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    gen0, gen1, gen2 = (int(value) for value in out.read_text().split())
    per = 1000 / requests
    return {
        "requests": requests,
        "gen0_per_1000": gen0 * per,
        "gen1_per_1000": gen1 * per,
        "gen2_per_1000": gen2 * per,
    }


def run(seconds: float = SECONDS) -> dict[str, dict[str, float]]:
    import tempfile

    from .alternatives import VARIANTS as SPECS

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-collections-") as name:
        for variant in VARIANTS:
            results[SPECS[variant].label] = measure(variant, seconds, Path(name))
    return results


def render(results: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            label,
            f"{row['requests']:,}",
            f"{row['gen0_per_1000']:.1f}",
            f"{row['gen1_per_1000']:.2f}",
            f"{row['gen2_per_1000']:.2f}",
        ]
        for label, row in results.items()
    ]
    return table(
        [
            f"uvicorn, hello world, wrk -c{CONNECTIONS}",
            "requests",
            "gen-0 collections per 1,000 requests",
            "gen-1",
            "gen-2",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve":
        serve(args[1], int(args[2]), args[3])
        return
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.collections")
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parsed = parser.parse_args(args)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    emit(render(run(parsed.seconds)))


if __name__ == "__main__":
    main()
