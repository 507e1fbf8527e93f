"""Where the vLLM server's CPU goes, without and with the middleware: py-spy on both servers.

`python -m benchmarks.serving_profile [--concurrency 8] [--prompts 128] [--reps 2] [--layout ab]`

Starts the vLLM target's two servers (as `python -m benchmarks serving` does), samples each API
server process with py-spy (`record --format raw`: collapsed stacks, only threads on a CPU)
while `vllm bench serve` runs against them in alternation, and reports, per variant: the API
process's CPU per request, py-spy's samples per request, the share of samples whose stack holds
an `asgi_cancel` frame, and the functions whose own samples per request differ most. py-spy
comes from PyPI into the AIPerf venv (`pip install py-spy`); the output goes to
benchmarks/results/serving_profile.json (serving_profile-LAYOUT.json for another layout).

`--layout`: `ab` starts the server without the middleware first (the default), `ba` the one
with it first, `aa` two servers without it (an A/A control, labelled `without` and `with`
in the output although neither has the middleware).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ._util import emit, loadavg, median, save
from .serving import AIPERF_VENV, FULL, alternating, bench_args, engine_lock
from .serving_servers import VARIANTS, VLLM_PYTHON, Pair, ensure_model

PY_SPY = AIPERF_VENV / "bin" / "py-spy"


def parse(path: Path) -> tuple[int, Counter[str], int]:
    """Total samples, own samples by function, samples with an asgi_cancel frame."""
    total = with_middleware = 0
    own: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        if any("asgi_cancel" in frame for frame in frames):
            with_middleware += count
        own[frames[-1]] += count
    return total, own, with_middleware


LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "ab": (("without", "without"), ("with", "with")),
    "ba": (("with", "with"), ("without", "without")),
    "aa": (("without", "without"), ("with", "without")),
}


def run(concurrency: int, prompts: int, reps: int, layout: str = "ab") -> dict[str, Any]:
    ensure_model()
    settings = replace(FULL, bench_prompts={concurrency: prompts})
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "prompts": prompts,
        "reps": reps,
        "layout": layout,
        "load_before": loadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-profile-") as scratch:
        work = Path(scratch)
        with engine_lock(False), Pair("vllm", work / "logs", LAYOUTS[layout]) as pair:
            spies = {
                variant: subprocess.Popen(
                    [
                        *(str(PY_SPY), "record", "--format", "raw", "--rate", "250"),
                        *("--nonblocking", "-o", str(work / f"{variant}.txt")),
                        *("-p", str(server.pid)),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                for variant, server in pair.servers.items()
            }
            time.sleep(2)
            jobs = []
            for rep in range(reps):
                for variant in alternating(rep):
                    jobs.append(
                        {
                            "args": bench_args(pair.servers[variant], settings, concurrency),
                            "out": str(work / f"{variant}-{rep}.json"),
                            "pid": pair.servers[variant].pid,
                        }
                    )
            (work / "jobs.json").write_text(json.dumps(jobs))
            subprocess.run(
                [str(VLLM_PYTHON), "-m", "benchmarks.serving_vllm_bench", str(work / "jobs.json")],
                check=True,
                capture_output=True,
                timeout=1800,
            )
            for spy in spies.values():
                spy.send_signal(signal.SIGINT)
            for spy in spies.values():
                spy.wait(60)
        for variant in VARIANTS:
            runs = [json.loads((work / f"{variant}-{rep}.json").read_text()) for rep in range(reps)]
            requests = sum(run["completed"] for run in runs)
            total, own, middleware = parse(work / f"{variant}.txt")
            result[variant] = {
                "cpu_ms_per_request": [
                    run["server_cpu_s"] * 1000 / run["completed"] for run in runs
                ],
                "request_throughput": [run["request_throughput"] for run in runs],
                "samples_per_request": total / requests,
                "asgi_cancel_share": middleware / total if total else 0.0,
                "own_per_request": {name: count / requests for name, count in own.items()},
            }
    without, with_ = result["without"]["own_per_request"], result["with"]["own_per_request"]
    names = set(without) | set(with_)
    deltas = sorted(names, key=lambda name: with_.get(name, 0) - without.get(name, 0))
    result["most_added"] = [
        (name, round(without.get(name, 0), 2), round(with_.get(name, 0), 2))
        for name in reversed(deltas[-15:])
    ]
    result["load_after"] = loadavg()
    for variant in VARIANTS:
        del result[variant]["own_per_request"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_profile")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="ab")
    args = parser.parse_args(argv)
    result = run(args.concurrency, args.prompts, args.reps, args.layout)
    for variant in VARIANTS:
        data = result[variant]
        emit(
            f"{variant}: CPU ms/request {[round(x, 1) for x in data['cpu_ms_per_request']]} "
            f"(median {median(data['cpu_ms_per_request']):.1f}), py-spy samples/request "
            f"{data['samples_per_request']:.1f}, asgi_cancel frames in "
            f"{data['asgi_cancel_share']:.2%} of samples"
        )
    emit("functions (own samples per request, without -> with), most added first:")
    for name, before, after in result["most_added"]:
        emit(f"  {before:8.2f} -> {after:8.2f}  {name}")
    save(
        "serving_profile" + ("" if args.layout == "ab" else f"-{args.layout}"), result, quick=False
    )


if __name__ == "__main__":
    main()
