"""The benchmarks' one server-subprocess harness: a command on a free port of 127.0.0.1.

`Process(argv, log=...)` starts `argv(port)` in its own process group with its output in `log`,
`wait_ready()` waits until `ready(port)` answers (or the process exits), `stop()` signals the
whole group (vLLM forks engine processes), then kills what is left. Standard library only: the
serving benchmark runs it in vLLM's venv too.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"


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
        stop_signal: int = signal.SIGINT,  # uvicorn's and hypercorn's graceful shutdown
    ) -> None:
        self.argv, self.log, self.ready, self.cwd = argv, log, ready, cwd
        self.env, self.timeout, self.stop_signal = dict(env or {}), timeout, stop_signal
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
        for sent in (self.stop_signal, signal.SIGKILL):  # SIGKILL: what ignored the first
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, sent)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(self.timeout)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def __enter__(self) -> Process:
        self.spawn().wait_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
