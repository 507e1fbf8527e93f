"""`python -m example_app demo --quick` runs end to end: the table, and the PNG beside it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from example_app.launch import PACKAGE_ROOT

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        importlib.util.find_spec("matplotlib") is None,
        reason="the demo's chart needs matplotlib (the example's dependencies)",
    ),
]


def test_quick_demo_prints_its_table_and_writes_its_chart(tmp_path: Path) -> None:
    chart = tmp_path / "out" / "demo.png"
    result = subprocess.run(
        [sys.executable, "-m", "example_app", "demo", "--quick", "--out", str(chart)],
        cwd=PACKAGE_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    table = result.stdout
    assert re.search(r"with asgi-cancel +without", table), table
    for row in (
        "tokens wasted on departed clients",
        "stayed clients: p50 latency",
        "stayed clients: p99 latency",
        "stayed clients: throughput",
    ):
        assert row in table
    assert f"chart: {chart}" in table
    assert chart.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert chart.stat().st_size > 10_000
    assert chart.with_suffix(".txt").read_text().strip() == table.split("\nchart:")[0].strip()
    assert "without: 16/16 clients" in result.stderr  # the progress report
    # One wording for who leaves: the progress output and the table's header agree.
    leaving = re.search(r"(\d+) try to leave early", table)
    assert leaving is not None, table
    assert f"16 clients, {leaving.group(1)} try to leave early" in result.stderr
    # The idle time is counted from the first client (the chart's axis), so it is shorter than
    # the quick load's watchdog and excludes server start and stop: well under the whole run.
    idle = re.findall(r"engine idle after ([\d.]+) s", result.stderr)
    assert len(idle) == 2, result.stderr
    assert all(0 < float(seconds) < 30 for seconds in idle)

    wasted = re.search(r"tokens wasted on departed clients +([\d,]+) +([\d,]+)", table)
    assert wasted is not None, table
    with_middleware, without = (int(group.replace(",", "")) for group in wasted.groups())
    assert with_middleware < without
    errors = re.search(r"client errors +(\d+) +(\d+)", table)
    assert errors is not None
    assert errors.groups() == ("0", "0")
