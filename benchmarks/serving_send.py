"""The middleware's cost on a streaming response, in process: per request and per `send`.

`python -m benchmarks.serving_send [--chunks N] [--requests R] [--rounds K]`

What the serving benchmark's ratios would have to be made of: a streaming ASGI app (a
response start, `chunks` SSE-sized body messages, an empty last one), served by a fake server
(uvicorn-like: `receive` returns the body, then blocks until the end; `send` is a no-op
coroutine), once bare and once behind `CancelOnDisconnectMiddleware`, under uvloop when it is
installed (vLLM's server runs on it). Like Starlette's `StreamingResponse` under ASGI spec
< 2.4, the app keeps a `receive()` pending while it streams. Rounds alternate bare/wrapped; the
result is the median time per request, and the difference divided by the number of sends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from asgi_cancel import CancelOnDisconnectMiddleware

from ._util import code_state, emit, median, save

CHUNK = b'data: {"id":"cmpl-0","object":"text_completion","choices":[{"text":"x"}]}\n\n'


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    await receive()  # the body
    listener = asyncio.ensure_future(receive())  # the app listens, as StreamingResponse does
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(scope["chunks"]):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    listener.cancel()


async def one_request(app: Any, chunks: int) -> None:
    done = asyncio.Event()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        return None

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "chunks": chunks}
    scope.update({"headers": [], "query_string": b"", "asgi": {"version": "3.0"}})
    await app(scope, receive, send)
    done.set()


async def measure(app: Any, chunks: int, requests: int) -> float:
    """Seconds per request, requests one after the other, each in its own task."""
    started = time.perf_counter()
    for _ in range(requests):
        await asyncio.ensure_future(one_request(app, chunks))
    return (time.perf_counter() - started) / requests


def run(chunks: int, requests: int, rounds: int) -> dict[str, Any]:
    try:
        import uvloop

        loop_name = "uvloop"
        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - the dev venv has uvloop
        loop_name, runner = "asyncio", asyncio.run
    wrapped = CancelOnDisconnectMiddleware(streaming_app)

    async def main() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"bare": [], "asgi-cancel": []}
        for count in (1, chunks):
            await measure(streaming_app, count, requests // 4)  # warm up
            await measure(wrapped, count, requests // 4)
        for _ in range(rounds):
            for name, app in (("bare", streaming_app), ("asgi-cancel", wrapped)):
                times[name].append(await measure(app, chunks, requests))
            for name, app in (("bare", streaming_app), ("asgi-cancel", wrapped)):
                times[f"{name} 1 chunk"] = times.get(f"{name} 1 chunk", [])
                times[f"{name} 1 chunk"].append(await measure(app, 1, requests))
        return times

    times = runner(main())
    per_request = {name: median(values) * 1e6 for name, values in times.items()}
    many = per_request["asgi-cancel"] - per_request["bare"]
    one = per_request["asgi-cancel 1 chunk"] - per_request["bare 1 chunk"]
    per_send = (many - one) / (chunks - 1)
    return {
        "loop": loop_name,
        "chunks": chunks,
        "requests": requests,
        "rounds": rounds,
        "us_per_request": per_request,
        "us_added_per_request_1_chunk": one,
        "us_added_per_request": many,
        "us_added_per_send": per_send,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_send")
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--save", action="store_true", help="to results/serving_send.json")
    args = parser.parse_args(argv)
    result = run(args.chunks, args.requests, args.rounds)
    result["command"] = "python -m benchmarks.serving_send " + " ".join(argv or sys.argv[1:])
    result["code"] = code_state()
    emit(json.dumps(result, indent=1))
    if args.save:
        save("serving_send", result, quick=False)


if __name__ == "__main__":
    main()
