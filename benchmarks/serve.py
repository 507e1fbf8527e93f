"""Run one variant under a real server, and start such servers from the harness.

Child side: `python -m benchmarks.serve SERVER VARIANT SCENARIO PORT [options]` (uvicorn with
httptools and uvloop, hypercorn with asyncio and h11; no access logs). `--gc-file`: the child
counts the collector's runs per generation from when it serves, and writes them there at exit.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from ._process import Process, server
from .alternatives import VARIANTS, TokenGenerator, build, python

SERVERS = ("uvicorn", "hypercorn")


@contextmanager
def servers(
    server: str, scenario: str, variants: Iterable[str], **options: Any
) -> Iterator[dict[str, Process]]:
    """A `server` process per variant serving `scenario`, with the child's `options` (a dict:
    one value per variant), started at once (they idle until measured) and stopped at the end."""
    with TemporaryDirectory(prefix="asgi-cancel-bench-") as logs:
        started: dict[str, Process] = {}
        try:
            for index, variant in enumerate(variants):
                argv = _command(server, variant, scenario, options)
                log = Path(logs) / f"{index}.log"
                started[variant] = Process(argv, log=log)
                started[variant].spawn()
            for process in started.values():
                process.start()
            yield started
        finally:
            for process in started.values():
                process.stop()


def _command(server: str, variant: str, scenario: str, options: dict[str, Any]) -> Any:
    def argv(port: int) -> list[str]:
        command = [python(variant), "-m", "benchmarks.serve", server, variant, scenario, str(port)]
        for key, value in options.items():
            value = value[variant] if isinstance(value, dict) else value
            command += [f"--{key.replace('_', '-')}", str(value)]
        return command

    return argv


# -- the child process -----------------------------------------------------------------------
def _recorder(path: str) -> Any:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(request_id: int, event: str) -> None:
        # time.monotonic(): one clock for every process on Linux, so the client can compare.
        os.write(fd, b"%d %s %.9f\n" % (request_id, event.encode(), time.monotonic()))

    return record


def _count_collections(path: str) -> None:
    counts = [0, 0, 0]

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    gc.collect()
    gc.callbacks.append(count)
    atexit.register(lambda: Path(path).write_text(" ".join(map(str, counts))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve")
    parser.add_argument("server", choices=SERVERS)
    parser.add_argument("variant", choices=list(VARIANTS))
    parser.add_argument("scenario", choices=["hello", "slow", "engine"])
    parser.add_argument("port", type=int)
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--events")
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--gc-file")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    options: dict[str, Any] = {"hold": args.hold}
    if args.events:
        options["record"] = _recorder(args.events)
    if args.scenario == "engine":
        options["engine"] = TokenGenerator(args.step_time, args.max_batch)
    run, _stop = server(args.server, build(args.variant, args.scenario, **options), args.port)
    if args.gc_file:
        _count_collections(args.gc_file)
    run()


if __name__ == "__main__":
    main()
