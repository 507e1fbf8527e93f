"""The demo's PNG: waste, latency, throughput, and the engine's batch over time, side by side."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .load import Load, Run, planned_leavers
from .report import summarize

COLORS = ("#2a9d8f", "#e76f51")  # with, without


def write_chart(path: Path, load: Load, runs: list[Run]) -> None:
    figure = build_figure(load, runs)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def build_figure(load: Load, runs: list[Run]) -> Figure:
    summaries = [summarize(run) for run in runs]
    labels = [run.label for run in runs]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5), layout="constrained")
    figure.suptitle(
        f"asgi-cancel demo: {load.clients} clients, {planned_leavers(load)} try to leave early "
        f"({load.max_tokens} tokens per request)"
    )

    wasted = axes[0][0]
    _bars(wasted, labels, [s.wasted for s in summaries], "{:,.0f}")
    wasted.set(title="tokens generated for clients that had gone", ylabel="tokens")

    latency = axes[0][1]
    width = 0.38
    for index, (label, summary) in enumerate(zip(labels, summaries, strict=True)):
        offsets = [position + (index - 0.5) * width for position in (0, 1)]
        bars = latency.bar(
            offsets, [summary.p50, summary.p99], width, label=label, color=COLORS[index]
        )
        latency.bar_label(bars, fmt="{:.2f}")
    latency.set_xticks([0, 1], ["p50", "p99"])
    latency.set_title("latency of the clients that stayed")
    latency.set_ylabel("seconds")
    latency.legend(loc="upper left")

    throughput = axes[1][0]
    _bars(throughput, labels, [s.throughput for s in summaries], "{:,.0f}")
    throughput.set(title="throughput of the clients that stayed", ylabel="tokens / second")

    timeline = axes[1][1]
    for run, color in zip(runs, COLORS, strict=True):
        times = [sample.at for sample in run.timeline]
        timeline.plot(times, [s.running for s in run.timeline], color=color, label=run.label)
        timeline.plot(times, [s.waiting for s in run.timeline], color=color, linestyle=":")
    timeline.set_title("engine: running (solid) and waiting (dotted) requests")
    timeline.set_xlabel("seconds since the first client")
    timeline.set_ylabel("requests")
    timeline.set_ylim(bottom=0)
    timeline.legend()

    _headroom(wasted)
    _headroom(latency, room=1.4)  # and the legend, above the bars
    _headroom(throughput)
    return figure


def _bars(axes: Axes, labels: list[str], values: list[float], fmt: str) -> None:
    axes.bar_label(axes.bar(labels, values, color=COLORS), fmt=fmt)


def _headroom(axes: Axes, room: float = 1.18) -> None:
    """Room above the tallest bar for its value label, inside the frame."""
    heights = [patch.get_height() for patch in axes.patches if isinstance(patch, Rectangle)]
    tallest = max(heights, default=0.0)
    axes.set_ylim(0, tallest * room if tallest > 0 else 1.0)
