"""The benchmarks' one server-subprocess harness: a command on a free port of 127.0.0.1.

`Process(argv, log=...)` starts `argv(port)` in its own process group with its output in `log`,
`wait_ready()` waits until `ready(port)` answers (or the process exits), `stop()` signals the
whole group (vLLM forks engine processes), then kills what is left. `server()` is the child's
side. Standard library only at import: the serving benchmark runs it in vLLM's venv too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
SERVERS = ("uvicorn", "hypercorn", "hypercorn-trio")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def answers(path: str) -> Callable[[int], bool]:
    """A readiness probe: `GET path` returns 200."""

    def probe(port: int) -> bool:
        with contextlib.closing(http.client.HTTPConnection(HOST, port, timeout=2)) as connection:
            try:
                connection.request("GET", path)
                return connection.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                return False

    return probe


class Process:
    def __init__(
        self,
        argv: Callable[[int], Sequence[str]],
        *,
        log: Path,
        ready: Callable[[int], bool] = listening,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.argv, self.log, self.ready, self.cwd = argv, log, ready, cwd
        self.env, self.timeout = dict(env or {}), timeout
        self.port, self.startup_s = 0, 0.0
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def spawn(self) -> Process:
        """Start without waiting: many servers can start at once, then `wait_ready()` each."""
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.startup_s = time.monotonic()
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                list(self.argv(self.port)),
                cwd=self.cwd,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> None:
        assert self.popen is not None
        deadline = time.monotonic() + self.timeout
        # Ready, and still running: the answer came from this process, not one that took the port.
        while not (self.ready(self.port) and self.popen.poll() is None):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                command = " ".join(self.argv(self.port))
                raise RuntimeError(f"`{command}` did not start:\n{self.log_tail()}")
            time.sleep(0.1)
        self.startup_s = time.monotonic() - self.startup_s

    def stop(self) -> None:
        popen, self.popen = self.popen, None
        if popen is None:
            return
        # SIGINT: uvicorn's and hypercorn's graceful shutdown; SIGKILL: what ignored it.
        for sent in (signal.SIGINT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, sent)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(self.timeout)

    def wait(self, timeout: float) -> int:
        """Wait for the process to end by itself; its exit code."""
        assert self.popen is not None
        return self.popen.wait(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def __enter__(self) -> Process:
        self.spawn().wait_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def server(
    name: str, app: Any, port: int, lifespan: str = "on"
) -> tuple[Callable[[], None], Callable[[], None]]:
    """`(run, stop)`: `name` (one of SERVERS; uvicorn with httptools and uvloop, hypercorn with
    its asyncio or trio worker) serving `app` on HOST:`port` until `stop()`, or SIGINT or
    SIGTERM (on trio: not gracefully). The server is imported here, not with this module."""
    if name == "uvicorn":
        import uvicorn

        options: dict[str, Any] = {"http": "httptools", "loop": "uvloop", "lifespan": lifespan}
        settings = uvicorn.Config(app, HOST, port, log_level="warning", access_log=False, **options)
        settings.load()  # its imports are not the requests' (serve.py counts collections after)
        running = uvicorn.Server(settings)
        return running.run, lambda: setattr(running, "should_exit", True)
    from hypercorn.config import Config

    config = Config()
    config.bind, config.accesslog, config.loglevel = [f"{HOST}:{port}"], None, "WARNING"
    served = app if lifespan == "on" else functools.partial(_without_lifespan, app)
    if name == "hypercorn-trio":
        import trio
        from hypercorn.trio import serve as serve_trio

        done = trio.Event()
        serving = functools.partial(serve_trio, served, config, shutdown_trigger=done.wait)
        return lambda: trio.run(serving), done.set
    from hypercorn.asyncio import serve

    stopped = asyncio.Event()

    async def run() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
        await serve(served, config, shutdown_trigger=stopped.wait)

    return lambda: asyncio.run(run()), stopped.set


async def _without_lifespan(app: Any, scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":  # answered here: hypercorn has no "off" as uvicorn has
        for event in ("startup", "shutdown"):
            await receive()
            await send({"type": f"lifespan.{event}.complete"})
        return
    await app(scope, receive, send)
