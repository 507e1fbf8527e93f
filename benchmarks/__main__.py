"""`python -m benchmarks overhead|latency|waste|memory|all|render|serving [--quick]`.

`--quick` runs each benchmark small and exits non-zero when one failed or measured nonsense
(never on a speed: CI machines are noisy): CI's test of the benchmarks.
"""

from __future__ import annotations

import argparse
import time

from . import render
from ._util import emit, loadavg, record, save
from .render import BENCHMARKS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="asgi-cancel side by side with the alternatives. Results go to "
        "benchmarks/results/*.json; `render` turns them into the docs' tables and plots.",
    )
    parser.add_argument("benchmark", choices=[*BENCHMARKS, "all", "render"])
    quick = "small and short, and checked: CI's test (writes to benchmarks/results/tmp/)"
    parser.add_argument("--quick", action="store_true", help=quick)
    group = parser.add_argument_group("serving (vLLM's benchmark and AIPerf; not part of `all`)")
    required = "fail unless vLLM, its benchmark and AIPerf all ran (CI's vLLM step)"
    group.add_argument("--require-tools", action="store_true", help=required)
    args = parser.parse_args(argv)
    if args.benchmark == "render":
        render.main(quick=args.quick)
        return
    problems: list[str] = []
    names = list(BENCHMARKS)[:-1] if args.benchmark == "all" else [args.benchmark]
    for name in names:
        module = BENCHMARKS[name]
        began, load_before = time.time(), loadavg()
        figures = module.run(args.quick)
        data = record(name, args.quick, began, load_before) | figures
        emit(module.render(data))
        emit(f"results: {save(data)}")
        checked = args.require_tools if name == "serving" else args.quick
        problems += module.check(data) if checked else []
    if problems:
        raise SystemExit("benchmarks: problems found:\n- " + "\n- ".join(problems))


if __name__ == "__main__":
    main()
