"""The benchmarks still run: each `--quick` benchmark writes its results and its table, and
`render` turns them into tables and plots. Never asserts a speed (CI machines are noisy).

Select with `pytest tests/test_benchmarks_quick.py` (or `-m servers`: they start real servers
on 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.benchmarks, pytest.mark.timeout(300)]


def run_quick(benchmark: str, results: Path) -> str:
    environment = {**os.environ, "BENCH_RESULTS": str(results)}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", benchmark, "--quick"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def render(results: Path) -> str:
    environment = {**os.environ, "BENCH_RESULTS": str(results)}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "render", "--quick"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return (results / "tables.md").read_text()


def read(results: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    assert data["benchmark"] == name
    assert data["quick"] is True
    return data


def assert_plot(results: Path, name: str) -> None:
    image = results / "img" / f"benchmarks-{name}.png"
    assert image.read_bytes().startswith(b"\x89PNG")


def test_overhead_quick_writes_tables_and_plot(tmp_path: Path) -> None:
    output = run_quick("overhead", tmp_path)
    data = read(tmp_path, "overhead")
    assert "**in-process**" in output
    for variant in ("baseline", "asgi-cancel", "vllm", "raw-baseline", "raw-asgi-cancel"):
        row = data["inproc"][variant]
        assert row["us_median"] > 0
        assert row["tasks_per_request"] >= 0
    if shutil.which("wrk") is not None:
        for server in ("uvicorn", "hypercorn"):
            assert f"**{server}**, hello-world JSON" in output
            assert data["servers"][server]["asgi-cancel"]["runs"]
    tables = render(tmp_path)
    assert "## overhead" in tables
    assert "| variant |" in tables
    assert_plot(tmp_path, "overhead")


def test_latency_quick_writes_tables_and_plot(tmp_path: Path) -> None:
    output = run_quick("latency", tmp_path)
    data = read(tmp_path, "latency")
    for server in ("uvicorn", "hypercorn"):
        assert f"**{server}**: close" in output
        for close in ("fin", "rst"):
            cells = data["results"][server][close]
            assert cells["floor"]["n"] > 0
            assert cells["asgi-cancel"]["n"] > 0
    tables = render(tmp_path)
    assert "## latency" in tables
    assert_plot(tmp_path, "latency")


def test_waste_quick_writes_tables_and_plot(tmp_path: Path) -> None:
    output = run_quick("waste", tmp_path)
    data = read(tmp_path, "waste")
    assert "**wasted work**" in output
    for variant in ("baseline", "asgi-cancel", "vllm"):
        run = data["summary"][variant]["runs"][0]
        assert run["departed"] + run["stayed"] == data["settings"]["clients"]
    tables = render(tmp_path)
    assert "## waste" in tables
    assert_plot(tmp_path, "waste")


def test_memory_quick_writes_tables_and_plot(tmp_path: Path) -> None:
    output = run_quick("memory", tmp_path)
    data = read(tmp_path, "memory")
    assert "**memory**" in output
    for variant in ("asgi-cancel", "vllm"):
        row = data["results"][variant]
        assert row["requests"] == data["settings"]["requests"]
        assert row["ended_by_disconnect"] + row["never_cancelled"] == row["requests"]
    tables = render(tmp_path)
    assert "## memory" in tables
    assert_plot(tmp_path, "memory")


@pytest.mark.parametrize("row", ["hello", "sleep"])
@pytest.mark.parametrize("wrap", ["bare", "asgi-cancel"])
def test_the_instruction_counting_loop_runs(row: str, wrap: str) -> None:
    """`python -m benchmarks.instructions --in-process` runs this child under callgrind; here
    without it (valgrind is optional), so that a broken harness shows in CI."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.instructions", "loop", row, wrap, "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]


@pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (.ci/run installs it)"
)
def test_no_extra_collections_under_keep_alive_load(tmp_path: Path) -> None:
    """`python -m benchmarks.collections`, asserting a count (not a speed): under uvicorn with
    32 keep-alive connections the middleware must not make the garbage collector run more
    often. A finished cycle that kept uvicorn's per-request objects (through a context uvicorn
    copied in its final send) made 29 generation-0 collections per 1,000 requests against 0.3."""
    from benchmarks.collections import measure

    bare = measure("baseline", 2, tmp_path)
    wrapped = measure("asgi-cancel", 2, tmp_path)
    assert bare["requests"] > 500, bare
    assert wrapped["requests"] > 500, wrapped
    assert wrapped["gen0_per_1000"] <= max(3.0, 3 * bare["gen0_per_1000"]), (bare, wrapped)
