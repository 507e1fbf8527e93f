"""Run `python -m example_app serve` as a real subprocess on 127.0.0.1 (for the demo and tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from . import metrics

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """A server subprocess; as a context manager, it is always terminated on exit.

    Args:
        *serve_args: extra `serve` arguments (e.g. `"--no-middleware"`).
        server: "hypercorn" or "uvicorn".
        ready_timeout: seconds to wait for `/health` to answer.
        env: environment variables to add for the server.
    """

    def __init__(
        self,
        *serve_args: str,
        server: str = "hypercorn",
        ready_timeout: float = 20.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.serve_args = serve_args
        self.server = server
        self.ready_timeout = ready_timeout
        self.env = dict(env or {})
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()
        self._saved_log: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
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

    def start(self) -> None:
        for _attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            command = [sys.executable, "-m", "example_app", "serve", "--host", "127.0.0.1"]
            command += ["--port", str(self.port), "--server", self.server, *self.serve_args]
            env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
            path = [str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])]
            env["PYTHONPATH"] = os.pathsep.join(path)
            self.process = subprocess.Popen(
                command, cwd=PACKAGE_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
            )
            if self._wait_ready():
                return
            if self.process.poll() is None:
                break  # running but not answering: not a port clash
            self.process = None
        raise RuntimeError(f"the server did not start:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        return False

    def metrics(self) -> dict[str, float]:
        response = httpx.get(f"{self.base_url}/metrics", timeout=5.0)
        response.raise_for_status()
        return metrics.parse(response.text)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the server's output (stdout and stderr), also after `close()`."""
        if self._saved_log is None:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
            self._log.seek(0, os.SEEK_END)
        else:
            text = self._saved_log
        return text[-limit:]

    def close(self) -> None:
        """Stop the server and keep its output for `log_tail()`."""
        self.stop()
        if self._saved_log is None:
            self._saved_log = self.log_tail(limit=1_000_000)
            self._log.close()
