"""`python -m benchmarks render [--quick]`: benchmarks/results/*.json into docs/benchmarks.md.

Rewrites the blocks between `<!-- BEGIN name -->` and `<!-- END name -->` and the latency plot in
docs/img/; `--quick` reads results/tmp/ and writes `tables.md` and the plot there instead.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from . import latency, memory, overhead, serving, waste
from ._util import ROOT, emit, load, results_dir, write_block
from .alternatives import VARIANTS

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


def _color(variant: str) -> str:
    if "asgi-cancel" in variant:
        return "#2a9d8f"
    return "#8d99ae" if variant == "floor" or "baseline" in variant else "#e76f51"


def plot_latency(data: dict[str, Any]) -> Any:
    names = data["variants"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.6), squeeze=False, sharey=True)
    for axis, (server_name, by_close) in zip(axes[0], data["results"].items(), strict=True):
        for index, variant in enumerate(names):
            for offset, close, marker in ((-0.15, "fin", "o"), (0.15, "rst", "x")):
                cell = by_close[close][variant]
                values, label = cell["latencies_ms"], close.upper() if index == 0 else None
                style = {"s": 10, "marker": marker, "color": _color(variant), "alpha": 0.6}
                axis.scatter([index + offset] * len(values), values, label=label, **style)
                if cell["never"]:
                    text = f"never\n{cell['never']}/{cell['n']}"
                    axis.annotate(text, (index, 2000.0), ha="center", fontsize=7, color="darkred")
        axis.set_yscale("log")
        axis.set_ylim(0.05, 6000)
        labels = [VARIANTS[v] for v in names]
        axis.set_xticks(range(len(names)), labels, rotation=40, ha="right", fontsize=7)
        axis.set_ylabel("close → CancelledError (ms, log)")
        axis.set_title(f"{server_name}: cancel latency (o FIN, x RST)", fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    return figure


# What `python -m benchmarks` runs (`all`: every one but the last) and renders.
BENCHMARKS: dict[str, Any] = {
    module.__name__.rpartition(".")[2]: module
    for module in (overhead, latency, waste, memory, serving)
}


def machine_block(data: dict[str, Any]) -> str:
    info = data["machine"]
    text = f"- CPU: {info['cpu']}, {info['cores']} cores (shared with other jobs), "
    text += f"{info['memory_gb']} GB RAM, Linux {info['kernel']}"
    for key, name in (("versions", "Python 3.11 venv"), ("versions_py312", "Python 3.12 venv")):
        if found := sorted(info.get(key, {}).items()):
            text += f"\n- {name}: " + ", ".join(f"{k} {v}" for k, v in found)
    return text


def main(quick: bool = False) -> None:
    folder = results_dir(quick)
    images = folder / "img" if quick else IMG
    blocks: dict[str, str] = {}
    for name, module in BENCHMARKS.items():
        data = load(name, folder)
        if data is None:
            emit(f"render: no {name} results in {folder}")
            continue
        blocks[name] = module.render(data)
        blocks.setdefault("machine", machine_block(data))
        if name == "latency":
            images.mkdir(parents=True, exist_ok=True)
            figure = plot_latency(data)
            figure.tight_layout()
            figure.savefig(images / "benchmarks-latency.png", dpi=80)
            plt.close(figure)
    if quick:
        text = "\n\n".join(f"## {name}\n\n{block}" for name, block in blocks.items())
        (folder / "tables.md").write_text(text + "\n")
        emit(f"render: {folder / 'tables.md'}, {images}")
        return
    for name, block in blocks.items():
        write_block(DOC, name, block)
    emit(f"render: tables -> {DOC}, plots -> {IMG}")
