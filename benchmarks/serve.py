"""Run one variant under a real server, and manage such servers from the harness.

Child side: `python -m benchmarks.serve --server uvicorn|hypercorn --variant V --scenario S
--port P [--cpu N] [--hold H] [--events FILE] [--step-time T --max-batch B]`.
uvicorn runs as `uvicorn app --http httptools --loop uvloop --no-access-log`; hypercorn with its
defaults (asyncio loop, h11) and no access log. Access logs are off for every variant alike: they
would add the same cost to each and hide the differences.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from example_app.launch import Subprocess, listening

from ._util import PY312, ROOT, process_cpu_seconds, process_runtime_ns

SERVERS = ("uvicorn", "hypercorn")


@dataclass
class Server:
    """A running server process for one variant."""

    server: str
    variant: str
    scenario: str
    python: str
    cpu: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    events: Path | None = None
    process: Subprocess | None = field(default=None, init=False, repr=False)

    def command(self, port: int) -> list[str]:
        command = [self.python, "-m", "benchmarks.serve", "--server", self.server]
        command += ["--variant", self.variant, "--scenario", self.scenario, "--port", str(port)]
        if self.cpu is not None:
            command += ["--cpu", str(self.cpu)]
        if self.events is not None:
            command += ["--events", str(self.events)]
        for key, value in self.options.items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        return command

    def start(self, events: Path | None = None) -> Server:
        """Spawn the server; `ready()` waits for it (many start at once, then all are awaited)."""
        self.events = events
        # SIGINT: uvicorn's and hypercorn's graceful shutdown, as a person at the terminal.
        self.process = Subprocess(
            self.command, ready=listening, cwd=ROOT, stop_signal=signal.SIGINT, stop_timeout=5.0
        )
        self.process.spawn()
        return self

    def ready(self) -> None:
        assert self.process is not None
        self.process.start()

    @property
    def port(self) -> int:
        assert self.process is not None
        return self.process.port

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def cpu_ns(self) -> int:
        return process_runtime_ns(self.pid)

    def stop(self) -> str:
        """Stop the server; return its output."""
        if self.process is None:
            return ""
        self.process.close()
        return self.process.log_text()


class Servers:
    """Start many servers at once (they idle until measured), stop them all at the end."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers

    def __enter__(self) -> Servers:
        try:
            for server in self.servers:
                server.start(server.events)
            for server in self.servers:
                server.ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def python_for(variant_python: str) -> str:
    return str(PY312) if variant_python == "3.12" else sys.executable


# -- the child process -----------------------------------------------------------------------
def _recorder(path: str | None) -> Any:
    if path is None:
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(request_id: int, event: str) -> None:
        os.write(fd, b"%d %s %.9f\n" % (request_id, event.encode(), time.monotonic()))

    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve")
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--events")
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--max-batch", type=int, default=16)
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    from .alternatives import build, simulated_engine

    options: dict[str, Any] = {"hold": args.hold}
    record = _recorder(args.events)
    if record is not None:
        options["record"] = record
    if args.scenario == "engine":
        options["engine"] = simulated_engine(args.step_time, args.max_batch)
    app = build(args.variant, args.scenario, **options)

    if args.server == "uvicorn":
        import uvicorn

        uvicorn.run(
            app,
            host="127.0.0.1",
            port=args.port,
            http="httptools",
            loop="uvloop",
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
    else:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{args.port}"]
        config.accesslog = None
        config.loglevel = "WARNING"
        shutdown = asyncio.Event()

        async def run() -> None:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGINT, shutdown.set)
            loop.add_signal_handler(signal.SIGTERM, shutdown.set)
            await serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]

        asyncio.run(run())


if __name__ == "__main__":
    main()
