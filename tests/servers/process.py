"""A server command as a subprocess on a free port of 127.0.0.1, for the real-server tests.

Standard library only: the real-vLLM tests import it from vLLM's own venv.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .client import HOST


class StartupError(RuntimeError):
    """The server never answered its readiness probe, on any of the ports tried."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """Start `argv(port)` on a free port and wait until `ready(port)`; `stop()` ends it.

    On this shared machine another process can take the free port before the server binds it;
    some servers then exit, others keep running without listening. Either way the server is
    stopped and started again on a fresh port, up to `attempts` times. The server's stdout and
    stderr go to `log`, rewritten at each start. It runs in its own process group, and `stop()`
    signals the whole group: granian and gunicorn fork workers.
    """

    def __init__(
        self,
        argv: Callable[[int], list[str]],
        *,
        ready: Callable[[int], bool],
        cwd: Path,
        env: Mapping[str, str],
        log: Path,
        ready_timeout: float,
        attempts: int,
        stop_timeout: float,
    ) -> None:
        self.argv = argv
        self.ready = ready
        self.cwd = cwd
        self.env = {**os.environ, **env}
        self.log = log
        self.ready_timeout = ready_timeout
        self.attempts = attempts
        self.stop_timeout = stop_timeout
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        attempts: list[str] = []
        for _ in range(self.attempts):
            self.port = free_port()
            with self.log.open("wb") as output:
                self.process = subprocess.Popen(
                    self.argv(self.port),
                    cwd=self.cwd,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                problem = self._wait_until_ready(self.process)
            except BaseException:  # a pytest-timeout or ^C while waiting
                self.stop()
                raise
            if problem is None:
                return
            self.stop()
            attempts.append(f"port {self.port}: {problem}\n{self.log_text()[-4000:]}")
        command = " ".join(self.argv(self.port))
        raise StartupError(f"{command}\n" + "\n\n".join(attempts))

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> str | None:
        """None once the probe answers; else what went wrong."""
        deadline = time.monotonic() + self.ready_timeout
        while process.poll() is None:
            # Still running after the probe answered: it was our server, not the port's thief.
            if self.ready(self.port) and process.poll() is None:
                return None
            if time.monotonic() > deadline:
                return f"not ready after {self.ready_timeout} s"
            time.sleep(0.1)
        return f"exited at startup with {process.returncode}"

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after `stop_timeout`."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: workers that outlived it
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:  # nothing of the group is left
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(self.stop_timeout)
        process.wait(self.stop_timeout)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""
