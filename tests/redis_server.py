"""A real `redis-server` on a free 127.0.0.1 port, for the broker's tests (Debian's package;
`.ci/run` installs it). Missing, the tests skip, except under `CI=true`, where they fail.
`frozen()` stops it with SIGSTOP for a bounded time: its connections stay open and silent, as
behind a black-holed network path."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from .servers.process import free_port

START_TIMEOUT = 10.0


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("CI") == "true":
                pytest.fail("redis-server is not installed (.ci/run installs it)")
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        options += ["--save", "", "--appendonly", "no", *self.args]
        self.process = subprocess.Popen(
            [binary, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    @contextmanager
    def frozen(self, at_most: float) -> Iterator[None]:
        """Redis stopped (SIGSTOP) until the block ends, and `at_most` seconds whatever the
        test does (a timer sends the SIGCONT): a failing test never leaves it frozen."""
        assert self.process is not None
        process = self.process
        process.send_signal(signal.SIGSTOP)
        timer = threading.Timer(at_most, process.send_signal, (signal.SIGCONT,))
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            process.send_signal(signal.SIGCONT)


@contextmanager
def running_redis(workdir: Path, args: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(workdir, args=args)
    server.start()
    try:
        yield server
    finally:
        server.stop()
