"""Start and stop real ASGI servers as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .client import HOST, get
from .events import EVENTS_ENV, EventLog
from .process import ServerProcess
from .process import StartupError as StartupError

TESTS_DIR = Path(__file__).resolve().parent.parent
START_TIMEOUT = 20.0
START_ATTEMPTS = 3
READY_PROBE_TIMEOUT = 2.0
STOP_TIMEOUT = 15.0


@dataclass(frozen=True)
class ServerSpec:
    """How to run one server; `argv(target, port)` is its command line."""

    name: str
    argv: Callable[[str, int], list[str]]
    # daphne (Twisted) reads the whole request body before it calls the app.
    buffers_request_body: bool = False
    # Seconds after the client left at which the server cancels a still-running app task
    # itself, post-response work included; None if it never does. (daphne also counts from the
    # end of a normal response, client still connected.)
    cancels_app_after: float | None = None

    def __str__(self) -> str:
        return self.name


def _uvicorn(http: str) -> Callable[[str, int], list[str]]:
    def argv(target: str, port: int) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", target, "--host", HOST, "--port", str(port),
            "--http", http, "--no-access-log",
        ]  # fmt: skip

    return argv


def _hypercorn(worker_class: str) -> Callable[[str, int], list[str]]:
    def argv(target: str, port: int) -> list[str]:
        return [
            sys.executable, "-m", "hypercorn", "-k", worker_class, "-b", f"{HOST}:{port}",
            "--graceful-timeout", "2", target,
        ]  # fmt: skip

    return argv


def _daphne(target: str, port: int) -> list[str]:
    return [sys.executable, "-m", "daphne", "-b", HOST, "-p", str(port), target]


# gunicorn's `--asgi-disconnect-grace-period` default: its asgi worker cancels the request task
# itself this long after the client left, post-response work included.
GUNICORN_GRACE = 3.0


def _gunicorn(*extra: str) -> Callable[[str, int], list[str]]:
    # gunicorn 27's native asyncio worker (`-k asgi`), one worker, no access log (the default).
    def argv(target: str, port: int) -> list[str]:
        return [
            sys.executable, "-m", "gunicorn", "-k", "asgi", "--workers", "1",
            "--bind", f"{HOST}:{port}", "--graceful-timeout", "2", *extra, target,
        ]  # fmt: skip

    return argv


def _granian(target: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "granian", "--interface", "asgi", "--host", HOST,
        "--port", str(port), "--workers", "1", "--no-ws", target,
    ]  # fmt: skip


UVICORN_HTTPTOOLS = ServerSpec("uvicorn-httptools", _uvicorn("httptools"))
UVICORN_H11 = ServerSpec("uvicorn-h11", _uvicorn("h11"))
HYPERCORN_ASYNCIO = ServerSpec("hypercorn-asyncio", _hypercorn("asyncio"))
HYPERCORN_TRIO = ServerSpec("hypercorn-trio", _hypercorn("trio"))
DAPHNE = ServerSpec("daphne", _daphne, buffers_request_body=True, cancels_app_after=10.0)
GRANIAN = ServerSpec("granian", _granian)
GUNICORN = ServerSpec("gunicorn", _gunicorn(), cancels_app_after=GUNICORN_GRACE)
# HTTP/1.1 and h2c on one port: prior-knowledge h2c from 127.0.0.1 (in the default
# --forwarded-allow-ips); "both" rather than "prior-knowledge" so the HTTP/1.1 ready probe is
# still served, not refused with 400.
GUNICORN_H2 = ServerSpec(
    "gunicorn-h2c",
    _gunicorn("--http-protocols", "h2,h1", "--http2-cleartext", "both"),
    cancels_app_after=GUNICORN_GRACE,
)
HTTP1_SERVERS = (
    UVICORN_HTTPTOOLS,
    UVICORN_H11,
    HYPERCORN_ASYNCIO,
    HYPERCORN_TRIO,
    DAPHNE,
    GRANIAN,
    GUNICORN,
)


@dataclass
class Server:
    spec: ServerSpec
    harness: ServerProcess
    events: EventLog

    @property
    def port(self) -> int:
        return self.harness.port

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.harness.process is not None, "the server was stopped"
        return self.harness.process

    def log(self) -> str:
        return self.harness.log_text()

    def stop(self) -> None:
        """End the server's whole process group (granian forks workers)."""
        self.harness.stop()

    def assert_no_traceback(self) -> None:
        log = self.log()
        assert "Traceback" not in log, f"{self.spec} logged a traceback:\n{log[-4000:]}"


def _says_hello(port: int) -> bool:
    try:
        # Our app says hello (not some other process that took the port).
        return get(port, "/hello", timeout=READY_PROBE_TIMEOUT).body == b"hello"
    except (OSError, ValueError, KeyError):  # not listening yet, or not answering properly
        return False


def start_server(spec: ServerSpec, target: str, workdir: Path) -> Server:
    """Start `target` under `spec` in `workdir` (its log and event files are there)."""
    events_path = workdir / "events.jsonl"
    python_path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    harness = ServerProcess(
        lambda port: spec.argv(target, port),
        ready=_says_hello,
        cwd=workdir,  # not the tests folder: nothing there may shadow a server import
        env={EVENTS_ENV: str(events_path), "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"},
        log=workdir / "server.log",
        ready_timeout=START_TIMEOUT,
        attempts=START_ATTEMPTS,
        stop_timeout=STOP_TIMEOUT,
    )
    harness.start()
    return Server(spec, harness, EventLog(events_path))


@contextmanager
def running_server(spec: ServerSpec, target: str, workdir: Path) -> Iterator[Server]:
    """Run `target` under `spec` until the block exits; the process group is always ended."""
    server = start_server(spec, target, workdir)
    try:
        yield server
    finally:
        server.stop()
