"""What a streamed chunk costs asgi-cancel, and the least it can cost a middleware that sees it.

`python -m benchmarks.floor [--python PY]`: an app that streams chunks (yielding to the loop
before each) runs under callgrind bare and behind each middleware below, with 5k and with 25k
chunks; the difference over 20k is the cost of a chunk. A middleware that sees the app's
messages adds at least its frame (which every resume of the app passes) and a Python call for
each `send`: the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Generator
from typing import Any

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

from ._util import emit

CHUNK = {"type": "http.response.body", "body": b"data: token\n\n", "more_body": True}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(scope["chunks"]):
        await asyncio.sleep(0)
        await send(CHUNK)
    await send({"type": "http.response.body"})


async def frame(scope: Scope, receive: Receive, send: Send) -> None:
    await app(scope, receive, send)


async def floor(scope: Scope, receive: Receive, send: Send) -> None:
    await app(scope, receive, lambda message: send(message))


class Stepped:
    """The rest of an app whose first step was taken by hand (what asgi-cancel awaits)."""

    def __init__(self, steps: Generator[Any, None, None]) -> None:
        self.steps = steps

    def __await__(self) -> Generator[Any, None, None]:
        return self.steps


async def stepped_floor(scope: Scope, receive: Receive, send: Send) -> None:
    steps = app(scope, receive, lambda message: send(message)).__await__()
    next(steps)  # the app's first wait (its first sleep), taken by hand,
    await asyncio.sleep(0)  # handed to the loop,
    await Stepped(steps)  # and the rest awaited


CASES: dict[str, tuple[ASGIApp, str]] = {
    "frame": (frame, "a frame that awaits the app"),
    "floor": (floor, "the floor: that frame, and a closure that forwards each message"),
    "stepped": (stepped_floor, "the floor, the app's first step taken by hand"),
    "asgi-cancel": (CancelOnDisconnectMiddleware(app), "asgi-cancel"),
}


async def serve(case: str, chunks: int) -> None:
    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError  # pragma: no cover

    async def send(message: Message) -> None:
        pass

    asgi = app if case == "bare" else CASES[case][0]
    await asgi({"type": "http", "path": "/", "headers": [], "chunks": chunks}, receive, send)


def instructions(python: str, case: str, chunks: int) -> int:
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python]
    command += ["-m", "benchmarks.floor", "--run", case, str(chunks)]
    env = os.environ | {"PYTHONHASHSEED": "0"}  # the same dict layouts in every run
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return int(re.findall(r"Collected : (\d+)", done.stderr)[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.floor", description=__doc__)
    parser.add_argument("--python", default=sys.executable, help="the interpreter to measure")
    parser.add_argument("--run", nargs=2, help=argparse.SUPPRESS)  # (under callgrind)
    args = parser.parse_args()
    if args.run:
        asyncio.run(serve(args.run[0], int(args.run[1])))
        return
    per_chunk = {}
    for case in ("bare", *CASES):
        more = instructions(args.python, case, 25_000) - instructions(args.python, case, 5_000)
        per_chunk[case] = more / 20_000
    emit(f"a chunk, bare: {per_chunk['bare']:,.0f} instructions; added by")
    for case, (_, what) in CASES.items():
        emit(f"- {what}: +{per_chunk[case] - per_chunk['bare']:,.0f}")


if __name__ == "__main__":
    main()
