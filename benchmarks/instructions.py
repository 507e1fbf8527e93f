"""Instructions per request inside a real server process, by callgrind.

`python -m benchmarks.instructions [--server uvicorn|hypercorn|hypercorn-trio]`: for each row of
ROWS the server runs under `valgrind --tool=callgrind --dump-before=getppid`, bare and wrapped in
the middleware side by side. This (uncounted) process sends warm-up requests over a keep-alive
connection, `GET /__mark`, the requests, `GET /__mark`; the server calls `os.getppid()` at each
mark, so callgrind's part 2 holds exactly those requests (plus a mark's worth in both columns).
Counts do not depend on the machine's load: they compare across commits on a shared machine.

Child side: `python -m benchmarks.instructions serve SERVER ROW WRAP PORT [WATCH_DELAY]`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from example_app.launch import HOST

from ._process import SERVERS, Process, server
from ._util import emit, table, versions

ROWS = {
    "hello": "hello world, never awaits",
    "sleep": "awaits asyncio.sleep(0.001), then answers",
    "watched": "awaits asyncio.sleep(0.02) (watched), then answers",
    "stream": "awaits asyncio.sleep(0.02), then 64 SSE chunks, yielding before each",
}
LABELS = {"uvicorn": "uvicorn (httptools, uvloop)", "hypercorn": "hypercorn (asyncio, h11)"}
LABELS |= {"hypercorn-trio": "hypercorn (trio, h11)", "in-process": "in process (uvloop)"}
# The stream row's chunks: what an LLM server's token stream looks like to the middleware.
CHUNKS = 64
WRAPS = ("bare", "asgi-cancel")
REQUESTS = 2000
WARM_UP = 300
# Under callgrind the awaiting row takes 2.74 ms per request against 1.28 ms at full speed
# (measured here): the middleware's default watch_delay is scaled by that factor, so that the
# requests that cross it under callgrind are those that would at full speed (the 20 ms rows').
# Unscaled, the count depended on the machine's load (a loaded run watched some requests).
CALLGRIND_SLOWDOWN = 2.14
# "registry" (ids), "broker" (ids, cancels carried by the Redis at $ASGI_CANCEL_REDIS_URL) or
# "timeout" (a 30 s deadline).
OPTION_ENV = "BENCH_MIDDLEWARE_OPTION"
OPTIONS = ("registry", "broker", "timeout")

Sleep = Callable[[float], Coroutine[Any, Any, None]]
_HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"5")]
_START = {"type": "http.response.start", "status": 200, "headers": _HEADERS}
_BODY = {"type": "http.response.body", "body": b"hello"}
_SSE_HEADERS = [(b"content-type", b"text/event-stream")]
_SSE_START = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
_CHUNK = {"type": "http.response.body", "body": b"data: token\n\n", "more_body": True}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


# -- server side (under valgrind) -------------------------------------------------------------
def build_app(
    row: str, wrap: str, watch_delay: float | None = None, sleep: Sleep = asyncio.sleep
) -> Any:
    """The row's app; `sleep` is the running loop's own (trio's on trio)."""
    delay = 0.001 if row == "sleep" else 0.02

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send(dict(_START))
        await send(dict(_BODY))

    async def sleeps(scope: Any, receive: Any, send: Any) -> None:
        await sleep(delay)
        await send(dict(_START))
        await send(dict(_BODY))

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await sleep(delay)
        await send(dict(_SSE_START))
        for _ in range(CHUNKS):
            await sleep(0)  # an engine's next output
            await send(dict(_CHUNK))
        await send(dict(_END))

    apps = {"hello": hello, "sleep": sleeps, "watched": sleeps, "stream": stream}
    return wrapped(apps[row], wrap, watch_delay)


def wrapped(app: Any, wrap: str, watch_delay: float | None = None) -> Any:
    """`app` bare, or in the middleware (with the option $BENCH_MIDDLEWARE_OPTION names)."""
    if wrap == "bare":
        return app
    import inspect

    from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry

    if watch_delay is None:
        default = inspect.signature(CancelOnDisconnectMiddleware).parameters["watch_delay"]
        watch_delay = default.default * CALLGRIND_SLOWDOWN
    option = os.environ.get(OPTION_ENV, "")
    extra: dict[str, Any] = {"timeout": 30.0} if option == "timeout" else {}
    if option == "registry":
        extra["registry"] = CancelRegistry()
    elif option == "broker":
        from asgi_cancel.redis import RedisBroker

        broker = RedisBroker(os.environ["ASGI_CANCEL_REDIS_URL"])
        extra["registry"] = CancelRegistry(broker=broker)
    return CancelOnDisconnectMiddleware(app, watch_delay=watch_delay, **extra)


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
    """The in-process mode's child: a task per request as a server makes one, no sockets, a
    no-op `send`; the awaiting row awaits a future set on the next loop iteration (no timer).
    Within ~0.2k of uvicorn's added instructions in ~6 s: the loop for trying a change."""
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


# -- client side (this process, not counted) --------------------------------------------------
def _get(connection: http.client.HTTPConnection, path: str) -> None:
    # `GET path HTTP/1.1` and `Host: bench`, no other header: what the server parses stays put.
    connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", "bench")
    connection.endheaders()
    connection.getresponse().read()


def drive(port: int, requests: int, connections: int = 1) -> None:
    """Warm-up, a mark, `requests` over `connections` keep-alive connections at once, a mark."""
    clients = [http.client.HTTPConnection(HOST, port, timeout=120) for _ in range(connections)]
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


def _callgrind(out: Path, python: str, option: str | None, *child: str) -> Process:
    """This module's child mode `child` (PORT: the process's port) under callgrind, started;
    part 2 of `out` is what lies between the child's two `os.getppid()` marks."""

    def argv(port: int) -> list[str]:
        command = ["valgrind", "--tool=callgrind", "--dump-before=getppid"]
        command += [f"--callgrind-out-file={out}", python, "-m", "benchmarks.instructions"]
        return command + [str(port) if arg == "PORT" else arg for arg in child]

    env = {"PYTHONHASHSEED": "0", OPTION_ENV: option or ""}
    process = Process(argv, log=out.with_suffix(".log"), env=env, timeout=300)
    process.spawn()
    return process


def _count(process: Process, requests: int) -> float:
    """Wait for a child's end; its instructions per request (callgrind's part 2)."""
    assert process.process is not None
    if process.process.wait(600) != 0:
        raise RuntimeError(f"callgrind's child failed:\n{process.log_tail()}")
    lines = process.log_path.with_suffix(".out.2").read_text(errors="replace").splitlines()
    totals = [line for line in lines if line.startswith(("totals:", "summary:"))]
    return int(totals[0].split()[1]) / requests


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
    in parallel (callgrind counts do not depend on load). `server_name` "in-process": `loop()`.
    `keep`: a folder for the callgrind files (`callgrind_annotate ROW-WRAP.out.2`)."""
    results: dict[str, dict[str, float]] = {}
    delay = () if watch_delay is None else (str(watch_delay),)
    served = server_name != "in-process"
    with tempfile.TemporaryDirectory(prefix="asgi-cancel-instr-") as name:
        folder = Path(name) if keep is None else keep
        folder.mkdir(parents=True, exist_ok=True)
        for row in rows:
            started: dict[str, Process] = {}
            for wrap in WRAPS:
                if served:
                    child: tuple[str, ...] = ("serve", server_name, row, wrap, "PORT", *delay)
                else:
                    child = ("loop", row, wrap, str(requests))
                started[wrap] = _callgrind(folder / f"{row}-{wrap}.out", python, option, *child)
            try:
                if served:  # both clients at once, as both servers run at once
                    for process in started.values():
                        process.start()
                    with ThreadPoolExecutor(len(WRAPS)) as pool:
                        ports = [process.port for process in started.values()]
                        list(pool.map(lambda port: drive(port, requests, connections), ports))
                results[row] = {
                    wrap: _count(process, requests) for wrap, process in started.items()
                }
            finally:
                for process in started.values():
                    process.stop()
    return results


def per_chunk(results: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """What a streamed chunk costs, bare and added: (the stream row - the watched row) / CHUNKS."""
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
        label = ROWS[row].replace("asyncio.", "trio." if "trio" in server_name else "asyncio.")
        if server_name == "in-process" and row != "hello":
            label = "awaits a future set on the next loop iteration"
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
    rows_help = "default: all, or hello and sleep in process (the others await as sleep does)"
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help=rows_help)
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--connections", type=int, default=1, help="sending at once")
    delay_help = f"the middleware's option (default: its default x {CALLGRIND_SLOWDOWN})"
    parser.add_argument("--watch-delay", type=float, help=delay_help)
    parser.add_argument("--option", choices=OPTIONS, help="a middleware option to turn on")
    python_help = "the interpreter the server runs in (it needs the server and asgi-cancel)"
    parser.add_argument("--python", default=sys.executable, help=python_help)
    in_process_help = "count in a loop without a server (~6 s: for trying changes)"
    parser.add_argument("--in-process", action="store_true", help=in_process_help)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parsed = parser.parse_args(args)
    server_name = "in-process" if parsed.in_process else parsed.server
    options = (parsed.keep, parsed.watch_delay, parsed.connections, parsed.option, parsed.python)
    rows = parsed.rows or (["hello", "sleep"] if parsed.in_process else list(ROWS))
    results = run(parsed.requests, tuple(rows), *options, server_name)
    found = versions(parsed.python)
    text = render(results, server_name)
    emit(f"{text}\n\nPython {found['python']}, {parsed.requests:,} requests per column")
    if parsed.json:
        data = {"server": server_name, "requests": parsed.requests, "versions": found}
        data |= {"option": parsed.option, "results": results, "per_chunk": per_chunk(results)}
        parsed.json.write_text(json.dumps(data, indent=1) + "\n")
        emit(f"results: {parsed.json}")


if __name__ == "__main__":
    main()
