"""Shared helpers: paths, statistics, machine facts, result files and text tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
# fastapi-disconnect needs Python >= 3.12: its columns run in their own venv (see docs).
PY312 = Path(os.environ.get("BENCH_PY312", ROOT / ".venv-bench312" / "bin" / "python"))
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The modules a request runs through (asyncio); their hash identifies the code measured.
CORE = (
    "__init__.py",
    "_asyncio.py",
    "_asyncio_task.py",
    "_cycle.py",
    "_middleware.py",
    "_token.py",
    "types.py",
)


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not values:
        return float("nan")
    data = sorted(values)
    rank = max(1, min(len(data), round(q / 100 * len(data) + 0.5)))
    return data[rank - 1]


def loadavg() -> tuple[float, float, float]:
    fields = Path("/proc/loadavg").read_text().split()
    return float(fields[0]), float(fields[1]), float(fields[2])


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_runtime_ns(pid: int) -> int:
    """Nanoseconds on CPU, summed over the threads' /proc/.../schedstat (finer than ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
    return total


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def versions(python: str | Path = sys.executable) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys, platform\n"
        "names = ['asgi-cancel', 'starlette', 'fastapi', 'uvicorn', 'hypercorn', 'httptools',"
        " 'uvloop', 'anyio', 'fastapi-disconnect']\n"
        "out = {'python': platform.python_version()}\n"
        "for name in names:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    found: dict[str, str] = json.loads(result.stdout)
    return found


def machine() -> dict[str, Any]:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions(),
    }
    if PY312.exists():
        info["versions_py312"] = versions(PY312)
    info["code"] = code_state()
    return info


def code_state() -> dict[str, Any]:
    """Which asgi-cancel was measured: the commit, and a hash of the core modules as run."""
    import hashlib

    digest = hashlib.sha256()
    for name in CORE:
        digest.update(name.encode() + b"\0" + (ROOT / "asgi_cancel" / name).read_bytes())
    state: dict[str, Any] = {"asgi_cancel_sha256": digest.hexdigest()[:16]}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *(f"asgi_cancel/{name}" for name in CORE)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        state["commit"] = head.stdout.strip()
        state["asgi_cancel_modified"] = bool(dirty.stdout.strip())
    except OSError:
        pass
    return state


def have_py312() -> bool:
    if not PY312.exists():
        return False
    probe = subprocess.run(
        [str(PY312), "-c", "import fastapi_disconnect, fastapi, uvicorn, hypercorn"],
        capture_output=True,
        cwd=ROOT,
    )
    return probe.returncode == 0


def results_dir(quick: bool) -> Path:
    """Full runs: benchmarks/results/ (committed). --quick: results/tmp/ (git-ignored).

    BENCH_RESULTS overrides both (the test suite points it at a temporary directory).
    """
    override = os.environ.get("BENCH_RESULTS")
    if override:
        return Path(override)
    return RESULTS / "tmp" if quick else RESULTS


def save(name: str, data: dict[str, Any], *, quick: bool) -> Path:
    folder = results_dir(quick)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def load(name: str, folder: Path) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table (also readable in a terminal)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def emit(text: str) -> None:
    """Print a result table (benchmarks are CLI tools; the package itself never prints)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
