"""4. Memory and leaks: many requests, each cancelled by a disconnect, in process.

Each variant runs in a fresh interpreter (`_inproc memory`): requests are started in batches,
each parks in its work (a one-hour sleep), then every client disconnects (uvicorn-style
receive: `http.disconnect` to every caller from then on) and the harness waits for each request
to end. Reported: RSS before and after (after a warm-up batch), tasks still alive afterwards,
the change in `len(gc.get_objects())` after `gc.collect()`, and how many requests the
alternative actually ended (polling behind `BaseHTTPMiddleware` and the baseline never do: they
are left out, see the latency table).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from ._util import ROOT, emit, fmt, have_py312, loadavg, machine, save, table
from .alternatives import VARIANTS
from .serve import python_for

MEMORY_VARIANTS = [
    "asgi-cancel",
    "vllm",
    "poll-1s",
    "poll-0.1s",
    "streaming",
    "asgi-cancel-py312",
    "fastapi-disconnect",
    "fastapi-disconnect-decorator",
]
NEVER_CANCEL = ["baseline", "poll-1s+bhm", "poll-0.1s+bhm"]
QUICK_VARIANTS = {"asgi-cancel", "vllm", "poll-0.1s", "streaming", "fastapi-disconnect"}


def run(quick: bool) -> dict[str, Any]:
    variants = list(MEMORY_VARIANTS)
    skipped: dict[str, str] = {
        name: "never cancels: every request would stay alive (see the latency table)"
        for name in NEVER_CANCEL
    }
    if not have_py312():
        for name in ("asgi-cancel-py312", "fastapi-disconnect", "fastapi-disconnect-decorator"):
            variants.remove(name)
            skipped[name] = "no Python 3.12 venv with fastapi-disconnect (see docs)"
    requests, batch = (2_000, 500) if quick else (100_000, 2_000)
    if quick:  # a subset: --quick proves that it runs
        for name in [v for v in variants if v not in QUICK_VARIANTS]:
            variants.remove(name)
            skipped[name] = "left out of --quick"
    started = time.time()
    load_before = loadavg()
    emit(f"memory: {requests:,} cancelled requests per variant, in process")
    results: dict[str, Any] = {}
    for variant in variants:
        completed = subprocess.run(
            [
                python_for(VARIANTS[variant].python),
                *("-m", "benchmarks._inproc", "memory", variant),
                *("--requests", str(requests), "--batch", str(batch)),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"memory {variant} failed:\n{completed.stderr[-3000:]}")
        results[variant] = json.loads(completed.stdout)
        emit(f"  {variant}: done in {results[variant]['seconds']:.1f} s")
    data = {
        "benchmark": "memory",
        "quick": quick,
        "command": " ".join(["python -m benchmarks memory", *(["--quick"] if quick else [])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
        "settings": {"requests": requests, "batch": batch},
        "variants": variants,
        "skipped": skipped,
        "results": results,
    }
    save("memory", data, quick=quick)
    emit(render(data))
    return data


def late_growth(row: dict[str, Any]) -> float:
    """RSS growth after the first tenth of the requests: what a leak would keep adding."""
    series = row.get("rss_series") or []
    if not series:
        return float("nan")
    tenth = next((rss for done, rss in series if done >= row["requests"] / 10), series[0][1])
    return float(series[-1][1] - tenth)


def render(data: dict[str, Any]) -> str:
    rows = []
    for variant in data["variants"]:
        row = data["results"][variant]
        mib = 1024 * 1024
        rows.append(
            [
                VARIANTS[variant].label,
                f"{row['ended_by_disconnect']:,}/{row['requests']:,}",
                fmt(row["rss_before"] / mib, 1),
                fmt(row["rss_after"] / mib, 1),
                fmt((row["rss_after"] - row["rss_before"]) / mib, 1),
                fmt(late_growth(row) / mib, 1),
                row["live_tasks_after"],
                f"{row['gc_objects_delta']:+,}",
                fmt(row.get("cyclic_garbage_per_request"), 0),
                fmt(row["seconds"] / row["requests"] * 1e6, 0),
            ]
        )
    out = (
        f"**memory**: {data['settings']['requests']:,} requests cancelled in process, "
        f"{data['settings']['batch']:,} at a time\n\n"
    )
    out += table(
        [
            "variant",
            "ended by the disconnect",
            "RSS before MiB",
            "RSS after MiB",
            "RSS delta MiB",
            "RSS growth over the last 90% MiB",
            "live tasks after",
            "gc objects delta",
            "objects left to the cyclic GC/request",
            "µs per cancelled request",
        ],
        rows,
    )
    for name, why in data.get("skipped", {}).items():
        out += f"\nskipped {name}: {why}"
    return out


if __name__ == "__main__":
    run("--quick" in sys.argv)
