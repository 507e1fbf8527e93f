"""Run the same load against the server with and without CancelOnDisconnectMiddleware.

The server runs twice as a real subprocess on 127.0.0.1 with the simulated engine. Concurrent
`openai` clients arrive over about a second; a fraction of them leave early (non-streaming
requests that hit their client timeout, streams closed after a few chunks). The table shows the
tokens the engine generated for clients that had gone, and the latency and throughput of the
clients that stayed; a PNG chart is written beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .load import Load, Run, plan, run_load
from .serve import SERVERS, SIM_MODEL_NAME


@dataclass(frozen=True)
class Engine:
    step_time: float = 0.01
    max_batch_size: int = 8


DEFAULT_LOAD = Load(
    clients=64,
    leave_fraction=0.5,
    max_tokens=64,
    ramp=1.0,
    timeouts=(0.3, 1.0),
    close_after=(2, 8),
)
QUICK_LOAD = replace(DEFAULT_LOAD, clients=16, max_tokens=32, ramp=0.3, timeouts=(0.15, 0.4))
QUICK_ENGINE = Engine(max_batch_size=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller load for CI (~10 s)")
    parser.add_argument("--clients", type=int, help=f"default {DEFAULT_LOAD.clients}")
    parser.add_argument(
        "--leave-fraction", type=float, help=f"default {DEFAULT_LOAD.leave_fraction}"
    )
    parser.add_argument("--max-tokens", type=int, help=f"default {DEFAULT_LOAD.max_tokens}")
    parser.add_argument("--server", choices=SERVERS, default="hypercorn")
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="run the load through `example_app gateway` over --backends engine servers, with "
        "and without asgi-cancel on the gateway, and report wasted tokens per backend",
    )
    parser.add_argument("--backends", type=int, default=2, help="with --gateway (default: 2)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("asgi-cancel-demo.png"),
        help="the chart (PNG); the table is also saved beside it as .txt",
    )


def main(args: argparse.Namespace) -> int:
    load = QUICK_LOAD if args.quick else DEFAULT_LOAD
    engine = QUICK_ENGINE if args.quick else Engine()
    overrides = {
        "clients": args.clients,
        "leave_fraction": args.leave_fraction,
        "max_tokens": args.max_tokens,
    }
    load = replace(load, **{name: value for name, value in overrides.items() if value is not None})
    if load.clients < 1 or not 0 <= load.leave_fraction <= 1 or load.max_tokens < 1:
        raise SystemExit("need --clients >= 1, 0 <= --leave-fraction <= 1, --max-tokens >= 1")
    if args.gateway:
        return main_gateway(args, load, engine)
    from .chart import write_chart  # matplotlib: fail now rather than after the runs

    runs = [
        run_server(load, engine, args.server, middleware=True),
        run_server(load, engine, args.server, middleware=False),
    ]
    table = format_table(load, engine, args.server, runs)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_chart(out, load, runs)
    out.with_suffix(".txt").write_text(table + "\n")
    sys.stdout.write(f"{table}\nchart: {out}\n")
    return 0


def main_gateway(args: argparse.Namespace, load: Load, engine: Engine) -> int:
    if args.backends < 1:
        raise SystemExit("need --backends >= 1")
    from .gateway_demo import run_gateway_demo

    leaving = planned_leavers(load)
    table = run_gateway_demo(
        load,
        engine.step_time,
        engine.max_batch_size,
        args.backends,
        args.server,
        lambda label: Progress(label, leaving=leaving),
    )
    out = args.out.resolve().with_suffix(".txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    sys.stdout.write(f"{table}\ntable: {out}\n")
    return 0


def run_server(load: Load, engine: Engine, server: str, *, middleware: bool) -> Run:
    label = "with asgi-cancel" if middleware else "without"
    serve_args = ["--step-time", str(engine.step_time)]
    serve_args += ["--max-batch-size", str(engine.max_batch_size), "--log-level", "warning"]
    if not middleware:
        serve_args.append("--no-middleware")
    from .launch import ServerProcess  # httpx: not needed by `serve`

    progress = Progress(label, leaving=planned_leavers(load))
    with ServerProcess(*serve_args, server=server) as process:
        progress(0, load.clients)
        try:
            run = asyncio.run(run_load(process.base_url, SIM_MODEL_NAME, load, label, progress))
        except BaseException:
            sys.stderr.write(f"\nserver output:\n{process.log_tail()}\n")
            raise
    progress.finish(run.idle_after)
    return run


class Progress:
    """A one-line text progress bar on stderr (a line per phase when stderr is not a TTY)."""

    def __init__(self, label: str, leaving: int = 0) -> None:
        self.label = label
        self.leaving = leaving
        self.tty = sys.stderr.isatty()
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self.tty:
            filled = round(24 * done / max(total, 1))
            bar = "#" * filled + "." * (24 - filled)
            counts = f"{done}/{total} clients, {self.leaving} try to leave early"
            sys.stderr.write(f"\r{self.label:>17} [{bar}] {counts}")
        elif done == 0:
            sys.stderr.write(
                f"{self.label}: {total} clients, {self.leaving} try to leave early ...\n"
            )
        sys.stderr.flush()

    def finish(self, idle_after: float) -> None:
        """`idle_after`: seconds from the first client to the engine idle, as on the chart.

        Server start and stop are not in it.
        """
        line = f"{self.done}/{self.total} clients, engine idle after {idle_after:.1f} s"
        if self.tty:
            sys.stderr.write(f", engine idle after {idle_after:.1f} s\n")
        else:
            sys.stderr.write(f"{self.label}: {line}\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class Summary:
    wasted: float
    generated: float
    aborted: float
    left: int
    stayed: int
    p50: float
    p99: float
    throughput: float
    errors: int


def summarize(run: Run) -> Summary:
    stayed = [result for result in run.results if result.plan.leave is None]
    latencies = sorted(result.latency for result in stayed) or [0.0]
    tokens = sum(result.tokens for result in stayed)
    last = max((result.finished_at for result in stayed), default=0.0)
    return Summary(
        wasted=run.final["example_engine_tokens_wasted_total"],
        generated=run.final["example_engine_tokens_generated_total"],
        aborted=run.final["example_engine_requests_aborted_total"],
        left=sum(result.outcome in ("timed out", "closed") for result in run.results),
        stayed=len(stayed),
        p50=statistics.median(latencies),
        p99=percentile(latencies, 0.99),
        throughput=tokens / last if last else 0.0,
        errors=sum(result.outcome.startswith("error") for result in run.results),
    )


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def planned_leavers(load: Load) -> int:
    """Clients that try to leave early (a few finish before their timeout)."""
    return sum(client.leave is not None for client in plan(load))


def format_table(load: Load, engine: Engine, server: str, runs: list[Run]) -> str:
    summaries = [summarize(run) for run in runs]
    planned = planned_leavers(load)
    rows = [
        ("tokens wasted on departed clients", [f"{s.wasted:,.0f}" for s in summaries]),
        (
            "  share of all tokens generated",
            [f"{s.wasted / s.generated:.0%}" if s.generated else "-" for s in summaries],
        ),
        ("engine requests aborted", [f"{s.aborted:,.0f}" for s in summaries]),
        ("clients that left early", [str(s.left) for s in summaries]),
        ("stayed clients: p50 latency", [f"{s.p50:.2f} s" for s in summaries]),
        ("stayed clients: p99 latency", [f"{s.p99:.2f} s" for s in summaries]),
        ("stayed clients: throughput", [f"{s.throughput:,.0f} tok/s" for s in summaries]),
        ("client errors", [str(s.errors) for s in summaries]),
    ]
    header = [
        f"asgi-cancel demo: {load.clients} openai clients; {load.clients - planned} stay to the "
        f"end, {planned} try to leave early",
        "  (non-streaming requests that hit a client timeout, streams closed after a few chunks)",
        f"simulated engine: batch {engine.max_batch_size}, {engine.step_time * 1000:g} ms/step, "
        f"{load.max_tokens} tokens per request; server: {server} on 127.0.0.1",
        "",
        f"{'':36}{runs[0].label:>18}{runs[1].label:>18}",
    ]
    lines = [f"{name:36}" + "".join(f"{cell:>18}" for cell in cells) for name, cells in rows]
    return "\n".join(header + lines)
