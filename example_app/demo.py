"""Run the same load against the server with and without CancelOnDisconnectMiddleware.

The server runs twice as a real subprocess on 127.0.0.1 with the simulated engine. Concurrent
`openai` clients arrive over about a second; a fraction of them leave early (non-streaming
requests that hit their client timeout, streams closed after a few chunks). The table shows the
tokens the engine generated for clients that had gone, and the latency and throughput of the
clients that stayed; a PNG chart is written beside it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import replace
from pathlib import Path

from .gateway_demo import run_gateway_demo
from .launch import ServerProcess
from .load import Load, Run
from .progress import run_pass
from .report import EngineConfig, format_table
from .serve import SERVERS, SIM_MODEL_NAME

DEFAULT_LOAD = Load(
    clients=64,
    leave_fraction=0.5,
    max_tokens=64,
    ramp=1.0,
    timeouts=(0.3, 1.0),
    close_after=(2, 8),
)
QUICK_LOAD = replace(DEFAULT_LOAD, clients=16, max_tokens=32, ramp=0.3, timeouts=(0.15, 0.4))
QUICK_ENGINE = EngineConfig(max_batch_size=4)


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
    engine = QUICK_ENGINE if args.quick else EngineConfig()
    overrides = {
        "clients": args.clients,
        "leave_fraction": args.leave_fraction,
        "max_tokens": args.max_tokens,
    }
    load = replace(load, **{name: value for name, value in overrides.items() if value is not None})
    if load.clients < 1 or not 0 <= load.leave_fraction <= 1 or load.max_tokens < 1:
        raise SystemExit("need --clients >= 1, 0 <= --leave-fraction <= 1, --max-tokens >= 1")
    # The clients' and the servers' dependencies: missing ones fail now, not after a run.
    for module in ("openai", "httpx", args.server):
        importlib.import_module(module)
    if args.gateway:
        return main_gateway(args, load, engine)
    from .chart import write_chart  # matplotlib, only for the chart

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


def main_gateway(args: argparse.Namespace, load: Load, engine: EngineConfig) -> int:
    if args.backends < 1:
        raise SystemExit("need --backends >= 1")
    table = run_gateway_demo(load, engine, args.backends, args.server)
    out = args.out.resolve().with_suffix(".txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    sys.stdout.write(f"{table}\ntable: {out}\n")
    return 0


def run_server(load: Load, engine: EngineConfig, server: str, *, middleware: bool) -> Run:
    label = "with asgi-cancel" if middleware else "without"
    serve_args = ["--step-time", str(engine.step_time)]
    serve_args += ["--max-batch-size", str(engine.max_batch_size), "--log-level", "warning"]
    if not middleware:
        serve_args.append("--no-middleware")
    with ServerProcess(*serve_args, server=server) as process:
        return run_pass(process, SIM_MODEL_NAME, load, label)
