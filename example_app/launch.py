"""Servers as subprocesses on 127.0.0.1: the one harness the demo, the tests and the benchmarks use.

`Subprocess` starts any server command on a free port, waits until the caller's probe answers
(trying a fresh port if the server exits at startup: on a shared machine another process can take
the port between the probe and the bind), writes the server's output to a log file, and stops the
server's whole process group (granian, gunicorn and vLLM fork workers). `ServerProcess` is
`python -m example_app serve` on top of it. Only the standard library is imported here, so the
real-vLLM tests can use it from vLLM's own venv.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of `GET path` on 127.0.0.1 (http.client: no proxy from the environment)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def answers(path: str, timeout: float = 2.0) -> Callable[[int], bool]:
    """A readiness probe: `GET path` returns 200."""

    def probe(port: int) -> bool:
        try:
            return http_get(port, path, timeout)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    return probe


def listening(port: int) -> bool:
    """A readiness probe: something accepts TCP connections on the port."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


class StartupError(RuntimeError):
    pass


class Subprocess:
    """A server subprocess on a free port; as a context manager, always stopped on exit.

    Args:
        argv: the command line for a port.
        ready: the readiness probe, given the port; the process must also still be running.
        cwd: working directory of the server.
        env: variables added to this process's environment for the server.
        log: file for the server's stdout and stderr (a temporary one if None); rewritten at
            each start.
        ready_timeout: seconds to wait for `ready` per attempt.
        poll: seconds between probes.
        attempts: starts on fresh ports when the server exits at startup (a port clash).
        retry_not_ready: also start again when the server runs but is not ready in time.
        stop_signal: sent to the process group first; SIGKILL follows after `stop_timeout`.
    """

    def __init__(
        self,
        argv: Callable[[int], Sequence[str]],
        *,
        ready: Callable[[int], bool],
        cwd: Path = PACKAGE_ROOT,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        ready_timeout: float = 20.0,
        poll: float = 0.05,
        attempts: int = 3,
        retry_not_ready: bool = False,
        stop_signal: int = signal.SIGTERM,
        stop_timeout: float = 10.0,
    ) -> None:
        self.argv = argv
        self.ready = ready
        self.cwd = cwd
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.poll = poll
        self.attempts = attempts
        self.retry_not_ready = retry_not_ready
        self.stop_signal = stop_signal
        self.stop_timeout = stop_timeout
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        if log is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="asgi-cancel-server-")
            log = Path(self._temporary.name) / "server.log"
        self.log_path = log
        self._saved_log: str | None = None
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        self.startup_seconds = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> Subprocess:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def spawn(self) -> None:
        """Start the process on a fresh port without waiting (`start()` then waits)."""
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.monotonic()
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                list(self.argv(self.port)),
                cwd=self.cwd,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, stopped as one
            )

    def start(self) -> None:
        """Spawn (unless `spawn()` was called) and wait until ready, on a fresh port if needed."""
        failures: list[str] = []
        for attempt in range(self.attempts):
            if self.process is None or attempt > 0:
                self.spawn()
            try:
                outcome = self._wait_ready()
            except BaseException:  # a pytest-timeout or ^C while waiting
                self.stop()
                raise
            if outcome is None:
                self.startup_seconds = time.monotonic() - self._started
                return
            failures.append(f"{outcome}:\n{self.log_tail()}")
            exited = self.process is not None and self.process.poll() is not None
            self.stop()
            if not (exited or self.retry_not_ready):
                break
        raise StartupError(f"{' '.join(self.argv(self.port))}\n" + "\n\n".join(failures))

    def _wait_ready(self) -> str | None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.process.poll() is not None:
                return f"exited at startup with {self.process.returncode}"
            # The probe answered, and from our process, not one that took the port.
            if self.ready(self.port) and self.process.poll() is None:
                return None
            if time.monotonic() > deadline:
                return f"not ready after {self.ready_timeout} s"
            time.sleep(self.poll)

    def stop(self) -> None:
        """Signal the process group, then SIGKILL what is left (a worker that ignored it)."""
        process, self.process = self.process, None
        if process is None:
            return
        for sent in (self.stop_signal, signal.SIGKILL):
            try:
                os.killpg(process.pid, sent)
            except ProcessLookupError:
                pass
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        process.wait(self.stop_timeout)

    def log_text(self) -> str:
        """The server's output so far (stdout and stderr), also after `close()`."""
        if self._saved_log is not None:
            return self._saved_log
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, limit: int = 4000) -> str:
        return self.log_text()[-limit:]

    def close(self) -> None:
        """Stop the server; a temporary log is kept in memory for `log_text()` and removed."""
        self.stop()
        if self._temporary is not None and self._saved_log is None:
            self._saved_log = self.log_text()
            self._temporary.cleanup()


def example_app_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a `python -m example_app ...` subprocess gets: example_app importable
    (it is not part of the installed wheel), output unbuffered, then `extra`."""
    python_path = [str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(python_path),
        **(extra or {}),
    }


class ServerProcess(Subprocess):
    """`python -m example_app serve` on 127.0.0.1, ready once `/health` answers.

    Args:
        *serve_args: extra `serve` arguments (e.g. `"--no-middleware"`).
        server: "hypercorn" or "uvicorn".
        ready_timeout: seconds to wait for `/health` to answer (a server that exits is
            reported at once). The simulated engine's server answers within 1-2 s here, but
            took over 20 s once on a loaded machine: the default leaves room for that.
        env: environment variables to add for the server.
    """

    def __init__(
        self,
        *serve_args: str,
        server: str = "hypercorn",
        ready_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        def argv(port: int) -> list[str]:
            command = [sys.executable, "-m", "example_app", "serve", "--host", HOST]
            return [*command, "--port", str(port), "--server", server, *serve_args]

        super().__init__(
            argv,
            ready=answers("/health", timeout=1.0),
            env=example_app_env(env),
            ready_timeout=ready_timeout,
        )
        self.server = server

    def __enter__(self) -> ServerProcess:
        super().__enter__()
        return self

    def metrics(self) -> dict[str, float]:
        from . import metrics  # the demo's and tests' side only

        status, body = http_get(self.port, "/metrics", timeout=5.0)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return metrics.parse(body.decode())
