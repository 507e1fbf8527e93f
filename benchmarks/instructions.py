"""Instructions per request inside a real uvicorn process (httptools, uvloop), by callgrind.

`python -m benchmarks.instructions` measures this: for each row (an app that never awaits,
an app that awaits `asyncio.sleep(0.001)` before answering) it starts uvicorn under
`valgrind --tool=callgrind --dump-before=getppid` once bare and once wrapped in
`CancelOnDisconnectMiddleware`, sends warm-up requests over one keep-alive connection from
this (uncounted) process, then `GET /__mark`, `requests` requests, `GET /__mark`. The server
calls `os.getppid()` for each mark, so callgrind's part 2 holds exactly those requests (plus
one mark's worth, the same for both columns). Counts do not depend on the machine's load,
which is what makes them comparable across commits on a shared machine.

Child side: `python -m benchmarks.instructions serve ROW WRAP PORT`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._process import free_port
from ._util import ROOT, emit, table

ROWS = {
    "hello": "hello world, never awaits",
    "sleep": "awaits asyncio.sleep(0.001), then answers",
    "watched": "awaits asyncio.sleep(0.02) (watched), then answers",
    "stream": "awaits asyncio.sleep(0.02), then 64 SSE chunks, yielding before each",
}
# The stream row's chunks: what an LLM server's token stream looks like to the middleware.
CHUNKS = 64
WRAPS = ("bare", "asgi-cancel")
REQUESTS = 2000
WARM_UP = 300
# Under callgrind the awaiting row takes 2.74 ms per request against 1.28 ms at full speed
# (measured here): the middleware's default watch_delay is scaled by that factor, so that the
# requests that cross it under callgrind are those that would at full speed (none of these).
# Unscaled, the count depended on the machine's load (a loaded run watched some requests).
CALLGRIND_SLOWDOWN = 2.14
# "registry" (ids), "broker" (ids, cancels carried by the Redis at $ASGI_CANCEL_REDIS_URL) or
# "timeout" (a 30 s deadline).
OPTION_ENV = "BENCH_MIDDLEWARE_OPTION"
OPTIONS = ("registry", "broker", "timeout")

_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")],
}
_BODY = {"type": "http.response.body", "body": b"hello"}
_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}
_CHUNK = {"type": "http.response.body", "body": b"data: token\n\n", "more_body": True}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


# -- server side (under valgrind) -------------------------------------------------------------
def build_app(row: str, wrap: str, watch_delay: float | None = None) -> Any:
    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send(dict(_START))
        await send(dict(_BODY))

    async def sleep(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.001)
        await send(dict(_START))
        await send(dict(_BODY))

    async def watched(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.02)
        await send(dict(_START))
        await send(dict(_BODY))

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.02)
        await send(dict(_SSE_START))
        for _ in range(CHUNKS):
            await asyncio.sleep(0)  # an engine's next output
            await send(dict(_CHUNK))
        await send(dict(_END))

    apps = {"hello": hello, "sleep": sleep, "watched": watched, "stream": stream}
    return wrapped(apps[row], wrap, watch_delay)


def wrapped(app: Any, wrap: str, watch_delay: float | None = None) -> Any:
    """`app` as the column `wrap` runs it: bare, or in the middleware (with the option the
    environment names)."""
    if wrap == "asgi-cancel":
        import inspect

        from asgi_cancel import CancelOnDisconnectMiddleware

        if watch_delay is None:
            default = inspect.signature(CancelOnDisconnectMiddleware).parameters["watch_delay"]
            watch_delay = default.default * CALLGRIND_SLOWDOWN
        extra: dict[str, Any] = {}
        option = os.environ.get(OPTION_ENV, "")
        if option in ("registry", "broker"):
            from asgi_cancel import CancelRegistry

            broker = None
            if option == "broker":
                from asgi_cancel.redis import RedisBroker

                broker = RedisBroker(os.environ["ASGI_CANCEL_REDIS_URL"])
            extra["registry"] = CancelRegistry(broker=broker)
        elif option == "timeout":
            extra["timeout"] = 30.0
        app = CancelOnDisconnectMiddleware(app, watch_delay=watch_delay, **extra)
    return app


def serve(row: str, wrap: str, port: int, watch_delay: float | None = None) -> None:
    import uvicorn

    app = build_app(row, wrap, watch_delay)
    server: Any = None

    async def front(scope: Any, receive: Any, send: Any) -> None:
        # The same dispatch for both columns: its cost cancels out of the difference.
        path = scope["path"]
        if path == "/__mark":
            os.getppid()  # callgrind --dump-before=getppid closes a part here
        elif path == "/__exit":
            server.should_exit = True
        else:
            await app(scope, receive, send)
            return
        await send(dict(_START))
        await send(dict(_BODY))

    config = uvicorn.Config(
        front,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    server.run()


def loop(row: str, wrap: str, requests: int) -> None:
    """The in-process mode's child: no server, no sockets. A task per request (as a server
    makes one), the app's `send` a no-op coroutine; the awaiting row awaits a future set on the
    next loop iteration (no timer of its own). It reproduces uvicorn's added instructions to
    ~0.2k in ~6 s, which makes it the loop for trying one change at a time."""
    import uvloop

    async def awaits(scope: Any, receive: Any, send: Any) -> None:
        running = asyncio.get_running_loop()
        future = running.create_future()
        running.call_soon(future.set_result, None)
        await future
        await send(dict(_START))
        await send(dict(_BODY))

    app = build_app(row, wrap) if row == "hello" else wrapped(awaits, wrap)
    request: dict[str, Any] = {"type": "http.request", "body": b"", "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: Any) -> None:
        pass

    async def one() -> None:
        await app({"type": "http", "path": "/", "method": "GET", "headers": []}, receive, send)

    async def main() -> None:
        running = asyncio.get_running_loop()
        for _ in range(WARM_UP):
            await running.create_task(one())
        os.getppid()  # callgrind --dump-before=getppid: part 2 is exactly the requests
        for _ in range(requests):
            await running.create_task(one())
        os.getppid()

    uvloop.run(main())


def run_in_process(
    requests: int = REQUESTS, rows: tuple[str, ...] = tuple(ROWS), python: str = sys.executable
) -> dict[str, dict[str, float]]:
    """Instructions per request in the in-process loop (`loop()`), bare and wrapped."""
    results: dict[str, dict[str, float]] = {}
    option = os.environ.get(OPTION_ENV, "")  # the loop takes no --option: the environment's
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-loop-instr-") as name:
        out = Path(name)
        for row in rows:
            started = [
                _spawn(out / f"{row}-{wrap}.out", python, option, "loop", row, wrap, str(requests))
                for wrap in WRAPS
            ]
            results[row] = _counts(row, started, requests)
    return results


# -- client side (this process, not counted) --------------------------------------------------
def _request(sock: socket.socket, path: str) -> None:
    def receive() -> bytes:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += receive()
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if chunked:  # the stream row: its body ends with the last, empty chunk
        while not body.endswith(b"0\r\n\r\n"):
            body += receive()
    while len(body) < length:
        body += receive()


def _connect(port: int, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=120)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _spawn(
    out: Path, python: str, option: str, *child: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """This module's child mode `child` under callgrind; part 2 of `out` is what lies between
    the child's two `os.getppid()` marks."""
    command = ["valgrind", "--tool=callgrind", "--dump-before=getppid"]
    command += [f"--callgrind-out-file={out}", python, "-m", "benchmarks.instructions", *child]
    env = {**os.environ, "PYTHONHASHSEED": "0", OPTION_ENV: option}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    return process, out


def _counts(
    row: str,
    started: list[tuple[subprocess.Popen[bytes], Path]],
    requests: int,
    errors: list[BaseException] | None = None,
) -> dict[str, float]:
    """Wait for a row's two children; instructions per request of each column."""
    counts: dict[str, float] = {}
    for wrap, (process, out) in zip(WRAPS, started, strict=True):
        _stdout, stderr = process.communicate(timeout=600)
        if errors or process.returncode != 0:
            raise RuntimeError(
                f"callgrind {row}/{wrap} failed ({errors}):\n{stderr.decode()[-2000:]}"
            )
        counts[wrap] = _totals(Path(f"{out}.2")) / requests
    return counts


def drive(port: int, requests: int, connections: int = 1) -> None:
    """WARM_UP requests, a mark, `requests` requests over `connections` keep-alive connections
    at once (one client thread each), a mark."""
    import threading

    with _connect(port, time.monotonic() + 300) as sock:
        others = [_connect(port, time.monotonic() + 300) for _ in range(connections - 1)]
        for _ in range(WARM_UP):
            _request(sock, "/")
        _request(sock, "/__mark")

        def some(client: socket.socket, count: int) -> None:
            for _ in range(count):
                _request(client, "/")

        share = requests // connections
        threads = [threading.Thread(target=some, args=(other, share)) for other in others]
        for thread in threads:
            thread.start()
        some(sock, requests - share * len(others))
        for thread in threads:
            thread.join()
        _request(sock, "/__mark")
        for other in others:
            other.close()
        _request(sock, "/__exit")


def _totals(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def run(
    requests: int = REQUESTS,
    rows: tuple[str, ...] = tuple(ROWS),
    keep: Path | None = None,
    watch_delay: float | None = None,
    connections: int = 1,
    option: str | None = None,
    python: str = sys.executable,
) -> dict[str, dict[str, float]]:
    """Instructions per request for every row, bare and wrapped; the two columns of a row run
    in parallel (callgrind counts do not depend on load). `keep`: a folder for the callgrind
    files (`callgrind_annotate ROW-WRAP.out.2` shows where the instructions go)."""
    import threading

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-uvicorn-instr-") as name:
        folder = Path(name) if keep is None else keep
        folder.mkdir(parents=True, exist_ok=True)
        for row in rows:
            ports = [free_port() for _ in WRAPS]
            delay = () if watch_delay is None else (str(watch_delay),)
            started = [
                _spawn(folder / f"{row}-{wrap}.out", python, option or "", *child)
                for wrap, port in zip(WRAPS, ports, strict=True)
                for child in [("serve", row, wrap, str(port), *delay)]
            ]
            errors: list[BaseException] = []

            def client(port: int, errors: list[BaseException] = errors) -> None:
                try:
                    drive(port, requests, connections)
                except BaseException as exc:  # reported below, with the server's stderr
                    errors.append(exc)

            threads = [threading.Thread(target=client, args=(port,)) for port in ports]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            results[row] = _counts(row, started, requests, errors)
    return results


def render(results: dict[str, dict[str, float]]) -> str:
    rows = []
    for row, counts in results.items():
        bare, wrapped = counts["bare"], counts["asgi-cancel"]
        added, ratio = f"+{(wrapped - bare) / 1e3:,.1f} k", f"x{wrapped / bare:.3f}"
        rows.append([ROWS[row], f"{bare / 1e3:,.1f} k", f"{wrapped / 1e3:,.1f} k", added, ratio])
    headers = ["uvicorn (httptools, uvloop), instructions/request", "bare", "asgi-cancel"]
    return table([*headers, "added", "ratio"], rows)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve":
        serve(args[1], args[2], int(args[3]), float(args[4]) if len(args) > 4 else None)
        return
    if args and args[0] == "loop":
        loop(args[1], args[2], int(args[3]))
        return
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--connections", type=int, default=1, help="sending at once")
    delay_help = f"the middleware's option (default: its default x {CALLGRIND_SLOWDOWN})"
    parser.add_argument("--watch-delay", type=float, help=delay_help)
    parser.add_argument("--option", choices=OPTIONS, help="a middleware option to turn on")
    python_help = "the interpreter that runs uvicorn (with httptools, uvloop and asgi-cancel)"
    parser.add_argument("--python", default=sys.executable, help=python_help)
    in_process_help = "count in a loop without a server (~6 s: for trying changes)"
    parser.add_argument("--in-process", action="store_true", help=in_process_help)
    parsed = parser.parse_args(args)
    if parsed.in_process:
        results = run_in_process(parsed.requests, tuple(parsed.rows), parsed.python)
        text = render(results).replace("uvicorn (httptools, uvloop)", "in process (uvloop)")
        emit(text.replace(ROWS["sleep"], "awaits a future set on the next loop iteration"))
        return
    rows, delay, option = tuple(parsed.rows), parsed.watch_delay, parsed.option
    counts = run(
        parsed.requests, rows, parsed.keep, delay, parsed.connections, option, parsed.python
    )
    emit(render(counts))


if __name__ == "__main__":
    main()
