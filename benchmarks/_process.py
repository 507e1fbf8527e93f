"""The benchmarks' servers as subprocesses: example_app/launch.py's harness, and `server()`.

`Process` is launch's `Subprocess` as the benchmarks start servers: one attempt, one `timeout`
for starting and for stopping, SIGINT first (uvicorn's and hypercorn's graceful shutdown), the
probe every 0.1 s. `server()` is the child's side. Standard library only at import (launch.py
too): the serving benchmark runs it in vLLM's venv.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from example_app.launch import HOST, Subprocess, listening

SERVERS = ("uvicorn", "hypercorn", "hypercorn-trio")


class Process(Subprocess):
    def __init__(
        self,
        argv: Callable[[int], Sequence[str]],
        *,
        log: Path,
        ready: Callable[[int], bool] = listening,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(
            argv,
            ready=ready,
            env=env,
            log=log,
            ready_timeout=timeout,
            poll=0.1,
            attempts=1,
            stop_signal=signal.SIGINT,
            stop_timeout=timeout,
        )


def server(
    name: str, app: Any, port: int, lifespan: str = "on"
) -> tuple[Callable[[], None], Callable[[], None]]:
    """`(run, stop)`: `name` (one of SERVERS; uvicorn with httptools and uvloop, hypercorn with
    its asyncio or trio worker) serving `app` on HOST:`port` until `stop()`, or SIGINT or
    SIGTERM (on trio: not gracefully). The server is imported here, not with this module."""
    if name == "uvicorn":
        import uvicorn

        options: dict[str, Any] = {"http": "httptools", "loop": "uvloop", "lifespan": lifespan}
        settings = uvicorn.Config(app, HOST, port, log_level="warning", access_log=False, **options)
        settings.load()  # its imports are not the requests' (serve.py counts collections after)
        running = uvicorn.Server(settings)
        return running.run, lambda: setattr(running, "should_exit", True)
    from hypercorn.config import Config

    config = Config()
    config.bind, config.accesslog, config.loglevel = [f"{HOST}:{port}"], None, "WARNING"
    served = app if lifespan == "on" else functools.partial(_without_lifespan, app)
    if name == "hypercorn-trio":
        import trio
        from hypercorn.trio import serve as serve_trio

        done = trio.Event()
        serving = functools.partial(serve_trio, served, config, shutdown_trigger=done.wait)
        return lambda: trio.run(serving), done.set
    from hypercorn.asyncio import serve

    stopped = asyncio.Event()

    async def run() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
        await serve(served, config, shutdown_trigger=stopped.wait)

    return lambda: asyncio.run(run()), stopped.set


async def _without_lifespan(app: Any, scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":  # answered here: hypercorn has no "off" as uvicorn has
        for event in ("startup", "shutdown"):
            await receive()
            await send({"type": f"lifespan.{event}.complete"})
        return
    await app(scope, receive, send)
