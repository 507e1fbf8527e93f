"""Start and stop real ASGI servers as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .client import HOST, get
from .events import EVENTS_ENV, EventLog

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
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    events: EventLog

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_no_traceback(self) -> None:
        log = self.log()
        assert "Traceback" not in log, f"{self.spec} logged a traceback:\n{log[-4000:]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_server(spec: ServerSpec, target: str, workdir: Path) -> Iterator[Server]:
    """Run `target` under `spec` until the block exits; the process group is always ended."""
    failures = []
    for attempt in range(START_ATTEMPTS):
        server = _start(spec, target, workdir, attempt)
        try:
            _wait_ready(server)
        except StartupError as exc:
            # Another process on this shared machine may take the free port before the server
            # binds it: try again on a fresh one, and say why if it never comes up.
            _stop(server.process)
            failures.append(str(exc))
            continue
        except BaseException:  # a pytest-timeout or ^C while waiting
            _stop(server.process)
            raise
        try:
            yield server
        finally:
            _stop(server.process)
        return
    raise StartupError("\n\n".join(failures))


class StartupError(RuntimeError):
    pass


def _start(spec: ServerSpec, target: str, workdir: Path, attempt: int) -> Server:
    port = free_port()
    events_path = workdir / "events.jsonl"
    log_path = workdir / f"server-{attempt}.log"
    env = dict(os.environ)
    env[EVENTS_ENV] = str(events_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            spec.argv(target, port),
            cwd=workdir,  # not the tests folder: nothing there may shadow a server import
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: granian forks workers
        )
    return Server(spec, port, process, log_path, EventLog(events_path))


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if server.process.poll() is not None:
            raise StartupError(f"{server.spec} exited at startup:\n{server.log()}")
        try:
            response = get(server.port, "/hello", timeout=READY_PROBE_TIMEOUT)
            # Our app says hello, and our process is the one listening.
            if response.body == b"hello" and server.process.poll() is None:
                return
        except (OSError, ValueError, KeyError):  # not listening yet, or not answering properly
            pass
        if time.monotonic() > deadline:
            raise StartupError(f"{server.spec} not ready after {START_TIMEOUT} s:\n{server.log()}")
        time.sleep(0.1)


def _stop(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    # Leftovers (a worker that ignored SIGTERM) and the leader if it hung.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(STOP_TIMEOUT)
