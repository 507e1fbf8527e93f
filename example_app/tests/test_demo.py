"""`python -m example_app demo`: the table, the chart and the progress line, end to end."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest

from example_app.demo import QUICK_LOAD
from example_app.launch import ServerProcess
from example_app.load import planned_leavers, run_load
from example_app.progress import Progress

from .helpers import MODEL, run_example

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        importlib.util.find_spec("matplotlib") is None,
        reason="the demo's chart needs matplotlib (the example's dependencies)",
    ),
]


def numbers(table: str, row: str) -> list[int]:
    """The figures of a table's row, one per column."""
    found = re.search(rf"^{re.escape(row)} +([\d,]+) +([\d,]+)$", table, re.MULTILINE)
    assert found is not None, table
    return [int(group.replace(",", "")) for group in found.groups()]


def test_the_quick_demo_prints_its_table_and_writes_its_chart(tmp_path: Path) -> None:
    chart = tmp_path / "out" / "demo.png"
    result = run_example("demo", "--quick", "--out", str(chart), timeout=150)
    assert result.returncode == 0, result.stderr[-4000:]
    table, err = result.stdout, result.stderr
    assert re.search(r"with asgi-cancel +without", table), table
    for row in ("p50 latency", "p99 latency", "throughput"):
        assert f"stayed clients: {row}" in table
    assert f"chart: {chart}" in table
    assert chart.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert chart.with_suffix(".txt").read_text().strip() == table.split("\nchart:")[0].strip()
    with_middleware, without = numbers(table, "tokens wasted on departed clients")
    assert with_middleware < without
    assert numbers(table, "client errors") == [0, 0]
    # One wording for who leaves, in the progress lines and the table's header.
    planned = planned_leavers(QUICK_LOAD)
    leaving = f"{planned} try to leave early"
    assert f"16 openai clients; {16 - planned} stay to the end, {leaving}" in table
    assert f"without: 16 clients, {leaving}" in err
    # The idle time is counted from the first client (the chart's axis), not server start.
    idle = re.findall(r"without: 16/16 clients, engine idle after ([\d.]+) s", err)
    assert len(idle) == 1, err
    assert 0 < float(idle[0]) < 30


def test_the_progress_bar_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("without", leaving=8)
    progress.tty = True
    progress(16, 16)
    progress.finish(1.234)
    assert capsys.readouterr().err == (
        f"\r{'without':>17} [{'#' * 24}] 16/16 clients, 8 try to leave early"
        ", engine idle after 1.2 s\n"
    )


def test_the_chart_labels_sit_in_their_frames_and_the_running_curves_end_at_zero() -> None:
    import matplotlib.pyplot as plt

    from example_app.chart import build_figure

    load = replace(QUICK_LOAD, clients=4, max_tokens=8)
    with ServerProcess("--step-time", "0.005", "--log-level", "warning") as process:
        run = asyncio.run(run_load(process.base_url, MODEL, load, "with", lambda *_: None))
    assert run.timeline[-1].at == run.idle_after == max(sample.at for sample in run.timeline)
    figure = build_figure(load, [run, replace(run, label="without")])
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        *bars, timeline = figure.axes
        for axes in bars:
            frame = axes.get_window_extent(renderer)
            assert axes.texts, axes.get_title()
            for text in axes.texts:  # the bars' value labels
                box = text.get_window_extent(renderer)
                assert frame.x0 <= box.x0 <= box.x1 <= frame.x1, (axes.get_title(), text)
                assert frame.y0 <= box.y0 <= box.y1 <= frame.y1, (axes.get_title(), text)
        running = [line for line in timeline.get_lines() if line.get_linestyle() == "-"]
        assert [list(line.get_ydata())[-1] for line in running] == [0, 0]  # type: ignore[arg-type]
        assert f"{planned_leavers(load)} try to leave early" in figure.get_suptitle()
    finally:
        plt.close(figure)


def test_the_demo_through_the_gateway(tmp_path: Path) -> None:
    out = tmp_path / "demo.png"
    result = run_example("demo", "--gateway", "--quick", "--clients", "8", "--out", str(out))
    assert result.returncode == 0, result.stderr
    table = out.with_suffix(".txt").read_text()
    assert "backend 1 (:" in table
    assert "backend 2 (:" in table
    aborted = re.findall(r"^  engine requests aborted +([\d,]+) +[\d,]+$", table, re.MULTILINE)
    assert len(aborted) == 2
    # The bound pass aborted the requests of clients that left (on one backend or the other).
    assert sum(int(count) for count in aborted) >= 1
    # Per backend, the tokens nobody read (the gateway names each response's backend) add up
    # to the all-backends figure, plus the warm-up's two one-token requests.
    per_backend = re.findall(r"^  tokens nobody read +([\d,]+) +([\d,]+)$", table, re.MULTILINE)
    everyone = numbers(table, "all backends: tokens nobody read")
    assert len(per_backend) == 2
    for column, total in enumerate(everyone):
        backends = sum(int(row[column].replace(",", "")) for row in per_backend)
        assert 0 <= backends - total <= 2
