"""Start and stop real ASGI servers as subprocesses on 127.0.0.1.

The server process has the repository on its path, so an app is named as in the tests
(`tests.servers.apps:app`) and the package it imports is this checkout's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    from uvicorn.config import WS_PROTOCOLS as UVICORN_WS
except ImportError:  # the servers extra is not installed: the suite says so when it runs
    UVICORN_WS = {}

from .client import HOST, get
from .events import EVENTS_ENV, EventLog
from .process import free_port

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent
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
    # How the middleware watches a request there (`events.watcher_kind()`): its watcher stepped
    # by hand where it knows the server's receive() (`_servers.steppable()`), else in a task.
    watcher: str = "HandStepped"

    def __str__(self) -> str:
        return self.name


def command(*args: str) -> Callable[[str, int], list[str]]:
    """`python -m <args>` as a `ServerSpec.argv`: `{target}`, `{host}`, `{port}` filled in."""

    def argv(target: str, port: int) -> list[str]:
        filled = (arg.format(target=target, host=HOST, port=port) for arg in args)
        return [sys.executable, "-m", *filled]

    return argv


UVICORN_ARGS = ("uvicorn", "{target}", "--host", "{host}", "--port", "{port}", "--no-access-log")
HYPERCORN_ARGS = ("hypercorn", "{target}", "-b", "{host}:{port}")
# gunicorn 27's native asyncio worker (`-k asgi`), one worker, no access log (the default).
GUNICORN_ARGS = (
    "gunicorn", "{target}", "-k", "asgi", "--workers", "1", "--bind", "{host}:{port}",
    "--graceful-timeout", "2",
)  # fmt: skip
# gunicorn's `--asgi-disconnect-grace-period` default: its asgi worker cancels the request task
# itself this long after the client left, post-response work included.
GUNICORN_GRACE = 3.0

UVICORN_HTTPTOOLS = ServerSpec("uvicorn-httptools", command(*UVICORN_ARGS, "--http", "httptools"))
UVICORN_H11 = ServerSpec("uvicorn-h11", command(*UVICORN_ARGS, "--http", "h11"))
HYPERCORN_ASYNCIO = ServerSpec(
    "hypercorn-asyncio", command(*HYPERCORN_ARGS, "-k", "asyncio", "--graceful-timeout", "2")
)
HYPERCORN_TRIO = ServerSpec(
    "hypercorn-trio",
    command(*HYPERCORN_ARGS, "-k", "trio", "--graceful-timeout", "2"),
    watcher="trio",
)
# daphne cancels a still-running app task itself 10 s after the client left, or after the end
# of a normal response (post-response work included).
DAPHNE = ServerSpec(
    "daphne",
    command("daphne", "-b", "{host}", "-p", "{port}", "{target}"),
    buffers_request_body=True,
)
GRANIAN_ARGS = (
    "granian", "--interface", "asgi", "--host", "{host}", "--port", "{port}", "--workers", "1",
)  # fmt: skip
GRANIAN = ServerSpec("granian", command(*GRANIAN_ARGS, "--no-ws", "{target}"))
GUNICORN = ServerSpec("gunicorn", command(*GUNICORN_ARGS), watcher="Task")
# HTTP/1.1 and h2c on one port: prior-knowledge h2c from 127.0.0.1 (in the default
# --forwarded-allow-ips); "both" rather than "prior-knowledge" so the HTTP/1.1 ready probe is
# still served, not refused with 400.
GUNICORN_H2 = ServerSpec(
    "gunicorn-h2c",
    command(*GUNICORN_ARGS, "--http-protocols", "h2,h1", "--http2-cleartext", "both"),
    watcher="Task",
)
HTTP1_SERVERS = (
    UVICORN_HTTPTOOLS, UVICORN_H11, HYPERCORN_ASYNCIO, HYPERCORN_TRIO, DAPHNE, GRANIAN, GUNICORN,
)  # fmt: skip
# Websockets: each of uvicorn's three implementations (`--ws websockets` is the legacy protocol
# of the `websockets` library; `websockets-sansio` from uvicorn 0.35), and granian with them on.
UVICORN_WEBSOCKETS = ServerSpec("uvicorn-websockets", command(*UVICORN_ARGS, "--ws", "websockets"))
UVICORN_WEBSOCKETS_SANSIO = ServerSpec(
    "uvicorn-websockets-sansio", command(*UVICORN_ARGS, "--ws", "websockets-sansio")
)
UVICORN_WSPROTO = ServerSpec("uvicorn-wsproto", command(*UVICORN_ARGS, "--ws", "wsproto"))
GRANIAN_WS = ServerSpec("granian", command(*GRANIAN_ARGS, "{target}"))
WS_SERVERS = (
    UVICORN_WEBSOCKETS,
    *([UVICORN_WEBSOCKETS_SANSIO] if "websockets-sansio" in UVICORN_WS else []),
    UVICORN_WSPROTO, HYPERCORN_ASYNCIO, HYPERCORN_TRIO, DAPHNE, GRANIAN_WS,
)  # fmt: skip


class StartupError(RuntimeError):
    """The server never answered its readiness probe, on any of the ports tried."""


class Server:
    """`spec` serving `target` as a subprocess on a free port of 127.0.0.1, from `start()` to
    `stop()`; its output goes to `workdir/server.log` (made if need be), its apps' events to
    `events`.

    On this shared machine another process can take the free port before the server binds it;
    some servers then exit, others keep running without listening. Either way the server is
    stopped and started again on a fresh port, up to START_ATTEMPTS times. It runs in its own
    process group, and `stop()` signals the whole group: granian and gunicorn fork workers.
    """

    def __init__(self, spec: ServerSpec, target: str, workdir: Path) -> None:
        self.spec = spec
        self.target = target
        self.workdir = workdir  # the cwd, not the tests folder: nothing may shadow an import
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        self.events = EventLog(workdir / "events.jsonl")
        # tests/ too, for targets named from there (`servers.apps:metrics`).
        path = [str(ROOT), str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, EVENTS_ENV: str(self.events.path), "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(path)
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self._process is not None, "the server was stopped"
        return self._process

    def start(self) -> None:
        attempts: list[str] = []
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            with self.log_path.open("wb") as output:
                self._process = subprocess.Popen(
                    self.spec.argv(self.target, self.port),
                    cwd=self.workdir,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                problem = self._wait_until_ready(self._process)
            except BaseException:  # a pytest-timeout or ^C while waiting
                self.stop()
                raise
            if problem is None:
                return
            self.stop()
            attempts.append(f"port {self.port}: {problem}\n{self.log()[-4000:]}")
        argv = " ".join(self.spec.argv(self.target, self.port))
        raise StartupError(f"{argv}\n" + "\n\n".join(attempts))

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> str | None:
        """None once the probe answers; else what went wrong."""
        deadline = time.monotonic() + START_TIMEOUT
        while process.poll() is None:
            # Still running after the probe answered: it was our server, not the port's thief.
            if _says_hello(self.port) and process.poll() is None:
                return None
            if time.monotonic() > deadline:
                return f"not ready after {START_TIMEOUT} s"
            time.sleep(0.1)
        return f"exited at startup with {process.returncode}"

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after STOP_TIMEOUT."""
        process, self._process = self._process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: workers that outlived it
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:  # nothing of the group is left
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT)
        process.wait(STOP_TIMEOUT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def assert_no_traceback(self) -> None:
        log = self.log()
        assert "Traceback" not in log, f"{self.spec} logged a traceback:\n{log[-4000:]}"


def _says_hello(port: int) -> bool:
    try:
        # Our app says hello (not some other process that took the port).
        return get(port, "/hello", timeout=READY_PROBE_TIMEOUT).body == b"hello"
    except (OSError, ValueError, KeyError):  # not listening yet, or not answering properly
        return False


@contextmanager
def running_server(spec: ServerSpec, target: str, workdir: Path) -> Iterator[Server]:
    """Run `target` under `spec` in `workdir` (its log and event files are there) until the
    block exits; the process group is always ended."""
    server = Server(spec, target, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def serving(spec: ServerSpec, target: str, tmp: pytest.TempPathFactory) -> Iterator[Server]:
    """`running_server` for a fixture: a fresh workdir, and a log without a traceback at the end."""
    with running_server(spec, target, tmp.mktemp(spec.name)) as server:
        yield server
        server.assert_no_traceback()
