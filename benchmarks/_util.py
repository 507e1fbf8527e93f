"""Shared helpers: paths, statistics, machine facts, result files and text tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PY312 = Path(os.environ.get("BENCH_PY312", ROOT / ".venv-bench312" / "bin" / "python"))


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not values:
        return float("nan")
    data = sorted(values)
    return data[max(1, min(len(data), round(q / 100 * len(data) + 0.5))) - 1]


def loadavg() -> list[float]:
    return [float(field) for field in Path("/proc/loadavg").read_text().split()[:3]]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def versions(python: str | Path = sys.executable) -> dict[str, str]:
    names = ["asgi-cancel", "starlette", "fastapi", "uvicorn", "hypercorn", "httptools"]
    code = (
        "import importlib.metadata as m, json, platform\n"
        "out = {'python': platform.python_version()}\n"
        f"for name in {[*names, 'uvloop', 'trio', 'fastapi-disconnect']!r}:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    found: dict[str, str] = json.loads(done.stdout)
    return found


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "?")
    memory_gb = round(int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2, 1)
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": memory_gb}
    info |= {"kernel": platform.release(), "versions": versions()}
    return info | ({"versions_py312": versions(PY312)} if PY312.exists() else {})


def results_dir(quick: bool) -> Path:
    """Full runs: benchmarks/results/ (committed); --quick: results/tmp/ (git-ignored)."""
    return RESULTS / "tmp" if quick else RESULTS


def record(name: str, quick: bool, started: float, load_before: list[float]) -> dict[str, Any]:
    """The facts every result file starts with; the benchmark adds its settings and figures."""
    command = f"python -m benchmarks {name}" + (" --quick" if quick else "")
    data = {"benchmark": name, "quick": quick, "command": command, "load_before": load_before}
    data |= {"seconds": round(time.time() - started), "load_after": loadavg()}
    return data | {"machine": machine()}


def _rounded(value: Any) -> Any:
    """Floats to 5 significant digits: the files stay small, and no figure needs more."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


def save(data: dict[str, Any]) -> Path:
    folder = results_dir(data["quick"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{data['benchmark']}.json"
    path.write_text(json.dumps(_rounded(data), indent=1, sort_keys=True) + "\n")
    return path


def load(name: str, folder: Path) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    data: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
    return data


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table (also readable in a terminal)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    return f"{value:,.{digits}f}"


def facts(data: dict[str, Any]) -> str:
    """The lines under a benchmark's tables: what was not run, the command, the machine's load."""
    skipped = "; ".join(f"{name}: {why}" for name, why in data["skipped"].items())
    skipped = f"Not run: {skipped}.\n\n" if skipped else ""
    before, after = (
        "/".join(f"{x:.2f}" for x in data[key]) for key in ("load_before", "load_after")
    )
    return skipped + (
        f"<sub>`{data['command']}` · {data['seconds']:.0f} s · load average (1/5/15 min) "
        f"before {before}, after {after}</sub>"
    )


def write_block(doc: Path, name: str, block: str) -> None:
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->` in `doc`."""
    text, begin, end = doc.read_text(), f"<!-- BEGIN {name} -->\n", f"<!-- END {name} -->"
    if begin not in text or end not in text:
        emit(f"render: {doc} has no BEGIN/END {name} block; left as is")
        return
    head, rest = text.split(begin, 1)
    doc.write_text(head + begin + block + "\n" + end + rest.split(end, 1)[1])


def emit(text: str) -> None:
    """Print a result table (benchmarks are CLI tools; the package itself never prints)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
