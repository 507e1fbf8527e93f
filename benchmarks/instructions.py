"""Instructions per request inside a real server process, by callgrind.

`python -m benchmarks.instructions [--server uvicorn|hypercorn|hypercorn-trio]`: for each row
(an app that never awaits, one that sleeps 1 ms, one that sleeps past `watch_delay`, one that then
streams CHUNKS chunks) the server (uvicorn: httptools, uvloop) runs under `valgrind
--tool=callgrind --dump-before=getppid` once bare and once wrapped in the middleware. This
(uncounted) process sends warm-up requests over one keep-alive connection, then `GET /__mark`,
`requests` requests, `GET /__mark`; the server calls `os.getppid()` at each mark, so callgrind's
part 2 holds exactly those requests (plus one mark's worth, the same in both columns). Counts do
not depend on the machine's load, which makes them comparable across commits on a shared machine.

Child side: `python -m benchmarks.instructions serve SERVER ROW WRAP PORT [WATCH_DELAY]`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._process import HOST, SERVERS, free_port, listening, server
from ._util import ROOT, emit, table, versions

ROWS = {
    "hello": "hello world, never awaits",
    "sleep": "awaits asyncio.sleep(0.001), then answers",
    "watched": "awaits asyncio.sleep(0.02) (watched), then answers",
    "stream": "awaits asyncio.sleep(0.02), then 64 SSE chunks, yielding before each",
}
LABELS = {
    "uvicorn": "uvicorn (httptools, uvloop)",
    "hypercorn": "hypercorn (asyncio, h11)",
    "hypercorn-trio": "hypercorn (trio, h11)",
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

Sleep = Callable[[float], Coroutine[Any, Any, None]]
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
def build_app(
    row: str, wrap: str, watch_delay: float | None = None, sleep: Sleep = asyncio.sleep
) -> Any:
    """The row's app; `sleep` is the running loop's own (trio's on trio)."""

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send(dict(_START))
        await send(dict(_BODY))

    async def sleep_1ms(scope: Any, receive: Any, send: Any) -> None:
        await sleep(0.001)
        await send(dict(_START))
        await send(dict(_BODY))

    async def watched(scope: Any, receive: Any, send: Any) -> None:
        await sleep(0.02)
        await send(dict(_START))
        await send(dict(_BODY))

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await sleep(0.02)
        await send(dict(_SSE_START))
        for _ in range(CHUNKS):
            await sleep(0)  # an engine's next output
            await send(dict(_CHUNK))
        await send(dict(_END))

    apps = {"hello": hello, "sleep": sleep_1ms, "watched": watched, "stream": stream}
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


def serve(name: str, row: str, wrap: str, port: int, watch_delay: float | None = None) -> None:
    sleep: Sleep = asyncio.sleep
    if name == "hypercorn-trio":
        import trio

        sleep = trio.sleep
    app = build_app(row, wrap, watch_delay, sleep)

    async def front(scope: Any, receive: Any, send: Any) -> None:
        # The same dispatch for both columns: its cost cancels out of the difference.
        path = scope["path"]
        if path == "/__mark":
            os.getppid()  # callgrind --dump-before=getppid closes a part here
        elif path == "/__exit":
            stop()
        else:
            await app(scope, receive, send)
            return
        await send(dict(_START))
        await send(dict(_BODY))

    run, stop = server(name, front, port, lifespan="off")
    run()


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
        for row in rows:
            started = [
                _spawn(Path(name) / f"{row}-{wrap}.out", python, option, "loop", row, wrap, count)
                for wrap in WRAPS
                for count in [str(requests)]
            ]
            results[row] = _counts(row, started, requests, [])
    return results


# -- client side (this process, not counted) --------------------------------------------------
def _connect(port: int) -> http.client.HTTPConnection:
    deadline = time.monotonic() + 300  # the server starts slowly under valgrind
    while not listening(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server on port {port}")
        time.sleep(0.2)
    return http.client.HTTPConnection(HOST, port, timeout=120)


def _get(connection: http.client.HTTPConnection, path: str) -> None:
    # `GET path HTTP/1.1` and `Host: bench`, no other header: what the server parses stays put.
    connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", "bench")
    connection.endheaders()
    connection.getresponse().read()


def drive(port: int, requests: int, connections: int = 1) -> None:
    """WARM_UP requests, a mark, `requests` requests over `connections` keep-alive connections
    at once (a client thread each), a mark."""
    clients = [_connect(port) for _ in range(connections)]
    for _ in range(WARM_UP):
        _get(clients[0], "/")
    _get(clients[0], "/__mark")
    share = requests // connections
    shares = [requests - share * (connections - 1)] + [share] * (connections - 1)

    def some(client: http.client.HTTPConnection, count: int) -> None:
        for _ in range(count):
            _get(client, "/")

    with ThreadPoolExecutor(connections) as pool:
        list(pool.map(some, clients, shares))  # a client's error is raised here
    _get(clients[0], "/__mark")
    for client in clients[1:]:
        client.close()
    _get(clients[0], "/__exit")


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
    errors: list[BaseException],
) -> dict[str, float]:
    """Wait for a row's two children; instructions per request of each column."""
    counts: dict[str, float] = {}
    for wrap, (process, out) in zip(WRAPS, started, strict=True):
        if errors:  # the client failed: the server waits for nothing more
            process.kill()
        _stdout, stderr = process.communicate(timeout=600)
        if errors or process.returncode != 0:
            raise RuntimeError(
                f"callgrind {row}/{wrap} failed ({errors}):\n{stderr.decode()[-2000:]}"
            )
        counts[wrap] = _totals(Path(f"{out}.2")) / requests
    return counts


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
    server_name: str = "uvicorn",
) -> dict[str, dict[str, float]]:
    """Instructions per request for every row, bare and wrapped; the two columns of a row run
    in parallel (callgrind counts do not depend on load). `keep`: a folder for the callgrind
    files (`callgrind_annotate ROW-WRAP.out.2` shows where the instructions go)."""
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-instr-") as name:
        folder = Path(name) if keep is None else keep
        folder.mkdir(parents=True, exist_ok=True)
        for row in rows:
            ports = [free_port() for _ in WRAPS]
            delay = () if watch_delay is None else (str(watch_delay),)
            started = [
                _spawn(folder / f"{row}-{wrap}.out", python, option or "", *child)
                for wrap, port in zip(WRAPS, ports, strict=True)
                for child in [("serve", server_name, row, wrap, str(port), *delay)]
            ]
            with ThreadPoolExecutor(len(ports)) as pool:
                done = [pool.submit(drive, port, requests, connections) for port in ports]
            errors = [error for future in done if (error := future.exception())]
            results[row] = _counts(row, started, requests, errors)
    return results


def per_chunk(results: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """What each streamed chunk costs: (the stream row - the watched row) / CHUNKS, bare, and
    added by the middleware."""
    if not {"stream", "watched"} <= results.keys():
        return None
    stream, watched = results["stream"], results["watched"]
    bare = (stream["bare"] - watched["bare"]) / CHUNKS
    return {"bare": bare, "added": (stream["asgi-cancel"] - watched["asgi-cancel"]) / CHUNKS - bare}


def render(results: dict[str, dict[str, float]], server_name: str = "uvicorn") -> str:
    rows = []
    for row, counts in results.items():
        bare, wrapped = counts["bare"], counts["asgi-cancel"]
        added, ratio = f"+{(wrapped - bare) / 1e3:,.1f} k", f"x{wrapped / bare:.3f}"
        label = ROWS[row]
        label = label.replace("asyncio.", "trio.") if server_name == "hypercorn-trio" else label
        rows.append([label, f"{bare / 1e3:,.1f} k", f"{wrapped / 1e3:,.1f} k", added, ratio])
    headers = [f"{LABELS[server_name]}, instructions/request", "bare", "asgi-cancel"]
    text = table([*headers, "added", "ratio"], rows)
    chunk = per_chunk(results)
    if chunk is not None:
        text += f"\n\nper streamed chunk ((stream - watched) / {CHUNKS}): "
        text += f"bare {chunk['bare'] / 1e3:,.2f} k, added {chunk['added'] / 1e3:+,.2f} k"
    return text


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve":
        delay = float(args[5]) if len(args) > 5 else None
        serve(args[1], args[2], args[3], int(args[4]), delay)
        return
    if args and args[0] == "loop":
        loop(args[1], args[2], int(args[3]))
        return
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("--server", choices=SERVERS, default="uvicorn")
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--connections", type=int, default=1, help="sending at once")
    delay_help = f"the middleware's option (default: its default x {CALLGRIND_SLOWDOWN})"
    parser.add_argument("--watch-delay", type=float, help=delay_help)
    parser.add_argument("--option", choices=OPTIONS, help="a middleware option to turn on")
    python_help = "the interpreter that runs the server (with it, its extras and asgi-cancel)"
    parser.add_argument("--python", default=sys.executable, help=python_help)
    in_process_help = "count in a loop without a server (~6 s: for trying changes)"
    parser.add_argument("--in-process", action="store_true", help=in_process_help)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parsed = parser.parse_args(args)
    rows = tuple(parsed.rows)
    if parsed.in_process:
        results = run_in_process(parsed.requests, rows, parsed.python)
        text = render(results).replace(LABELS["uvicorn"], "in process (uvloop)")
        text = text.replace(ROWS["sleep"], "awaits a future set on the next loop iteration")
    else:
        options = (parsed.keep, parsed.watch_delay, parsed.connections, parsed.option)
        results = run(parsed.requests, rows, *options, parsed.python, parsed.server)
        text = render(results, parsed.server)
    found = versions(parsed.python)
    emit(f"{text}\n\nPython {found['python']}, {parsed.requests:,} requests per column")
    if parsed.json:
        server_name = "in-process" if parsed.in_process else parsed.server
        data = {"server": server_name, "requests": parsed.requests, "versions": found}
        data |= {"option": parsed.option, "results": results, "per_chunk": per_chunk(results)}
        parsed.json.write_text(json.dumps(data, indent=1) + "\n")
        emit(f"results: {parsed.json}")


if __name__ == "__main__":
    main()
