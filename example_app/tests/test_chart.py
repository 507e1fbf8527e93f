"""The demo's chart: value labels inside their frames, running curves ending at 0, one wording."""

from __future__ import annotations

import importlib.util

import pytest

from example_app.demo import QUICK_LOAD
from example_app.launch import ServerProcess
from example_app.load import ClientResult, Run, Sample, plan, planned_leavers, run_load

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        importlib.util.find_spec("matplotlib") is None,
        reason="the demo's chart needs matplotlib (the example's dependencies)",
    ),
]


def fake_run(label: str, wasted: float, latency: float) -> Run:
    results = [
        ClientResult(client, "done" if client.leave is None else "timed out", latency, 1.0, 32)
        for client in plan(QUICK_LOAD)
    ]
    timeline = [Sample(0.1 * step, min(step, 4), max(0, 8 - step), 0.0) for step in range(12)]
    timeline.append(Sample(1.3, 0.0, 0.0, wasted))
    final = {
        "example_engine_tokens_wasted_total": wasted,
        "example_engine_tokens_generated_total": 1000.0,
        "example_engine_requests_aborted_total": 5.0,
    }
    return Run(label, results, timeline, final, wall=1.0, idle_after=1.3)


def test_labels_inside_frames_running_ends_at_zero_and_try_to_leave_wording() -> None:
    import matplotlib.pyplot as plt

    from example_app.chart import build_figure

    runs = [fake_run("with asgi-cancel", 0.0, 1.0), fake_run("without", 1152.0, 1.9)]
    figure = build_figure(QUICK_LOAD, runs)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        wasted, latency, throughput, timeline = figure.axes
        for axes in (wasted, latency, throughput):
            frame = axes.get_window_extent(renderer)
            assert axes.texts, axes.get_title()
            for text in axes.texts:  # the bars' value labels
                box = text.get_window_extent(renderer)
                where = (axes.get_title(), text)
                assert frame.y0 <= box.y0, where
                assert box.y1 <= frame.y1, where
                assert frame.x0 <= box.x0, where
                assert box.x1 <= frame.x1, where
        running = [line for line in timeline.get_lines() if line.get_linestyle() == "-"]
        assert len(running) == 2
        for line in running:
            assert list(line.get_ydata())[-1] == 0  # type: ignore[arg-type]
        title = figure.get_suptitle()
        assert f"{planned_leavers(QUICK_LOAD)} try to leave early" in title
    finally:
        plt.close(figure)


def test_a_run_timeline_ends_with_the_idle_engine() -> None:
    import asyncio

    load = QUICK_LOAD.__class__(**{**QUICK_LOAD.__dict__, "clients": 4, "max_tokens": 8})
    with ServerProcess("--step-time", "0.005", "--log-level", "warning") as process:
        run = asyncio.run(run_load(process.base_url, "sim-llm", load, "with", lambda *_: None))
    last = run.timeline[-1]
    assert (last.running, last.waiting) == (0.0, 0.0)
    assert last.at == run.idle_after
    assert all(sample.at <= last.at for sample in run.timeline)
