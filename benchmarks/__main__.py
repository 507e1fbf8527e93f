"""`python -m benchmarks overhead|latency|waste|memory|all|render|serving [--quick]`."""

from __future__ import annotations

import argparse
import time

from ._util import emit, loadavg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="asgi-cancel side by side with the alternatives. Results go to "
        "benchmarks/results/*.json; `render` turns them into docs/benchmarks tables and plots.",
    )
    parser.add_argument(
        "benchmark",
        choices=["overhead", "latency", "waste", "memory", "all", "render", "serving"],
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small and short: proves that everything runs (CI); writes *.quick.json",
    )
    group = parser.add_argument_group("serving (vLLM's bench, AIPerf; not part of `all`)")
    group.add_argument("--target", choices=["all", "sim", "vllm"], default="all")
    group.add_argument(
        "--require-tools",
        action="store_true",
        help="fail unless vLLM, vLLM's benchmark and AIPerf all ran (CI's vLLM step)",
    )
    group.add_argument(
        "--no-install", action="store_true", help="do not create .venv-aiperf when missing"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    emit(f"load average before: {loadavg()}")
    if args.benchmark == "render":
        from . import render

        render.main(quick=args.quick)
        return
    if args.benchmark == "serving":
        from . import serving

        targets = ["vllm", "sim"] if args.target == "all" else [args.target]
        serving.run(args.quick, targets, require=args.require_tools, install=not args.no_install)
        emit(f"done in {time.monotonic() - started:.0f} s; load average after: {loadavg()}")
        return
    names = (
        ["overhead", "latency", "waste", "memory"] if args.benchmark == "all" else [args.benchmark]
    )
    for name in names:
        module = __import__(f"benchmarks.{name}", fromlist=["run"])
        module.run(args.quick)
    emit(f"done in {time.monotonic() - started:.0f} s; load average after: {loadavg()}")


if __name__ == "__main__":
    main()
