"""Turn benchmarks/results/*.json into the plots and the tables that docs/benchmarks.md shows.

`python -m benchmarks render` rewrites the blocks between `<!-- BEGIN name -->` and
`<!-- END name -->` in docs/benchmarks.md and the PNGs in docs/img/. With `--quick` it reads the
quick results (benchmarks/results/tmp/) and writes `tables.md` and the PNGs next to them,
leaving the docs alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from . import latency, memory, overhead, waste
from ._util import ROOT, emit, load, results_dir
from .alternatives import VARIANTS
from .serve import SERVERS

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
OURS, FLOOR, OTHER, BASE = "#2a9d8f", "#8d99ae", "#e76f51", "#adb5bd"


def _color(variant: str) -> str:
    if "asgi-cancel" in variant:
        return OURS
    if variant in ("floor", "baseline", "baseline-py312", "raw-baseline"):
        return FLOOR if variant == "floor" else BASE
    return OTHER


def _save(figure: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_overhead(data: dict[str, Any], path: Path) -> None:
    servers = [(name, data["servers"][name]) for name in SERVERS if name in data["servers"]]
    panels = len(servers) + 1
    figure, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.2), squeeze=False)
    order = [variant for variants in data["server_groups"].values() for variant in variants]
    for axis, (server_name, summary) in zip(axes[0][:-1], servers, strict=True):
        names = [v for v in order if "cpu_ratio" in summary[v]]
        values = [summary[v]["cpu_ratio"] for v in names]
        axis.barh(range(len(names)), values, color=[_color(v) for v in names])
        axis.set_yticks(range(len(names)), [VARIANTS[v].label for v in names], fontsize=8)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.axvline(1.01, color="black", linewidth=0.8, linestyle=":")
        axis.set_xlabel("server CPU per request / baseline (same run)")
        axis.set_title(f"{server_name}: hello world under wrk", fontsize=10)
        axis.invert_yaxis()
    axis = axes[0][-1]
    inproc = data["inproc"]
    order = [variant for variants in data["groups"].values() for variant in variants]
    names = [v for v in order if v != inproc[v]["baseline"]]
    axis.barh(
        range(len(names)), [inproc[v]["us_added"] for v in names], color=[_color(v) for v in names]
    )
    axis.set_yticks(range(len(names)), [VARIANTS[v].label for v in names], fontsize=8)
    for index, name in enumerate(names):
        tasks = inproc[name]["tasks_per_request"]
        axis.annotate(
            f"{tasks:.0f} task{'s' if round(tasks) != 1 else ''}",
            (max(inproc[name]["us_added"], 0), index),
            xytext=(3, -3),
            textcoords="offset points",
            fontsize=7,
        )
    axis.set_xlabel("µs added per request (in process)")
    axis.set_title("in process: µs added, tasks", fontsize=10)
    axis.invert_yaxis()
    _save(figure, path)


def plot_latency(data: dict[str, Any], path: Path) -> None:
    servers = [(name, data["results"][name]) for name in SERVERS if name in data["results"]]
    figure, axes = plt.subplots(
        1, len(servers), figsize=(6 * len(servers), 4.6), squeeze=False, sharey=True
    )
    names = data["variants"]
    for axis, (server_name, by_close) in zip(axes[0], servers, strict=True):
        for index, variant in enumerate(names):
            for offset, close, marker in ((-0.15, "fin", "o"), (0.15, "rst", "x")):
                cell = by_close[close][variant]
                values = cell["latencies_ms"]
                if values:
                    axis.scatter(
                        [index + offset] * len(values),
                        values,
                        s=10,
                        marker=marker,
                        color=_color(variant),
                        alpha=0.6,
                        label=close.upper() if index == 0 else None,
                    )
                if cell["never"]:
                    axis.annotate(
                        f"never\n{cell['never']}/{cell['n']}",
                        (index, 2000.0),
                        ha="center",
                        fontsize=7,
                        color="darkred",
                    )
        axis.set_yscale("log")
        axis.set_ylim(0.05, 6000)
        axis.set_xticks(
            range(len(names)),
            [VARIANTS[v].label for v in names],
            rotation=40,
            ha="right",
            fontsize=7,
        )
        axis.set_ylabel("close → CancelledError (ms, log)")
        axis.set_title(f"{server_name}: cancel latency (o FIN, x RST)", fontsize=10)
        axis.grid(axis="y", which="major", alpha=0.3)
    _save(figure, path)


def plot_waste(data: dict[str, Any], path: Path) -> None:
    names = data["variants"]
    summary = data["summary"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = [_color(v) for v in names]
    labels = [VARIANTS[v].label for v in names]
    left.barh(range(len(names)), [summary[v]["wasted_tokens"] for v in names], color=colors)
    left.set_yticks(range(len(names)), labels, fontsize=8)
    left.set_xlabel("tokens generated for clients that had left")
    left.invert_yaxis()
    right.barh(range(len(names)), [summary[v]["stayer_tokens_per_s"] for v in names], color=colors)
    right.set_yticks(range(len(names)), [""] * len(names))
    right.set_xlabel("throughput of the clients that stayed (tokens/s)")
    right.invert_yaxis()
    figure.suptitle("wasted work: 64 clients, half leave early (simulated engine)", fontsize=10)
    _save(figure, path)


def plot_memory(data: dict[str, Any], path: Path) -> None:
    names = data["variants"]
    results = data["results"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = [_color(v) for v in names]
    labels = [VARIANTS[v].label for v in names]
    mib = 1024 * 1024
    left.barh(
        range(len(names)),
        [(results[v]["rss_after"] - results[v]["rss_before"]) / mib for v in names],
        color=colors,
    )
    left.set_yticks(range(len(names)), labels, fontsize=8)
    left.set_xlabel("RSS growth over the run (MiB)")
    left.invert_yaxis()
    right.barh(
        range(len(names)),
        [results[v]["seconds"] / results[v]["requests"] * 1e6 for v in names],
        color=colors,
    )
    right.set_yticks(range(len(names)), [""] * len(names))
    right.set_xlabel("wall µs per cancelled request (incl. polling waits)")
    right.invert_yaxis()
    requests = data["settings"]["requests"]
    figure.suptitle(f"memory: {requests:,} cancelled requests per variant", fontsize=10)
    _save(figure, path)


def facts(data: dict[str, Any]) -> str:
    code = data["machine"].get("code", {})
    load_before, load_after = data["load_before"], data["load_after"]
    return (
        f"\n\n<sub>`{data['command']}` · started {data['started']} · {data['seconds']:.0f} s · "
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/"
        f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/"
        f"{load_after[2]:.2f} · asgi-cancel source sha256 {code.get('asgi_cancel_sha256', '?')}"
        f" (commit {code.get('commit', '?')}"
        f"{', with uncommitted changes' if code.get('asgi_cancel_modified') else ''})</sub>"
    )


def machine_block(data: dict[str, Any]) -> str:
    info = data["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(info["versions"].items()))
    lines = [
        f"- CPU: {info['cpu']}, {info['cores']} cores (shared with other jobs), "
        f"{info['memory_gb']} GB RAM, Linux {info['kernel']}",
        f"- Python 3.11 venv: {versions}",
    ]
    if "versions_py312" in info:
        versions312 = ", ".join(f"{k} {v}" for k, v in sorted(info["versions_py312"].items()))
        lines.append(f"- Python 3.12 venv (fastapi-disconnect columns): {versions312}")
    return "\n".join(lines)


RENDERERS = {
    "overhead": (overhead.render, plot_overhead),
    "latency": (latency.render, plot_latency),
    "waste": (waste.render, plot_waste),
    "memory": (memory.render, plot_memory),
}


def main(quick: bool = False, source: Path | None = None) -> dict[str, str]:
    folder = source if source is not None else results_dir(quick)
    images = folder / "img" if quick or source is not None else IMG
    blocks: dict[str, str] = {}
    for name, (render_table, plot) in RENDERERS.items():
        data = load(name, folder)
        if data is None:
            emit(f"render: no {name} results in {folder}")
            continue
        image = images / f"benchmarks-{name}.png"
        plot(data, image)
        blocks[name] = render_table(data) + facts(data)
        blocks.setdefault("machine", machine_block(data))
        emit(f"render: {name} -> {image}")
    if quick or source is not None:
        (folder / "tables.md").write_text(
            "\n\n".join(f"## {name}\n\n{text}" for name, text in blocks.items()) + "\n"
        )
    else:
        update_doc(DOC, blocks)
    return blocks


def update_doc(path: Path, blocks: dict[str, str]) -> None:
    text = path.read_text()
    for name, block in blocks.items():
        pattern = re.compile(
            rf"(<!-- BEGIN {name} -->\n)(?:.*?\n)?(<!-- END {name} -->)", flags=re.DOTALL
        )
        text, count = pattern.subn(_replacement(block), text)
        if count == 0:
            emit(f"render: {path} has no BEGIN/END {name} block; left as is")
    path.write_text(text)
    emit(f"render: tables -> {path}")


def _replacement(block: str) -> Callable[[re.Match[str]], str]:
    def replace(match: re.Match[str]) -> str:
        return match.group(1) + block + "\n" + match.group(2)

    return replace
