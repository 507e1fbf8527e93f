"""Every way a user gets "stop the work when the client leaves", written as its users write it.

`build(variant, scenario)`: the same FastAPI app (handlers unannotated, as vLLM's are) for
`hello` (`GET /`), `slow` (`GET /slow?id=N` holds `hold` seconds, records its cancellation) or
`engine` (`GET /generate?id=N&tokens=T` streams from a `TokenGenerator`). `raw-*` are bare ASGI
apps (the worst case for relative overhead); `floor` listens for `http.disconnect` itself.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from ._util import PY312

Recorder = Callable[[int, str], None]
Handler = Callable[..., Coroutine[Any, Any, Any]]

VARIANTS = {  # name: label
    "baseline": "no middleware",
    "asgi-cancel": "asgi-cancel",
    # vLLM's decorator (vllm/entrypoints/serve/utils/api_utils.py), see with_cancellation().
    "vllm": "vLLM @with_cancellation",
    # The polling decorator of FastAPI discussion 8805, see cancel_on_disconnect_polling().
    "poll-1s": "poll is_disconnected 1 s",
    "poll-0.1s": "poll is_disconnected 0.1 s",
    # The same in an app that also has an `@app.middleware("http")` (here a pass-through one).
    "poll-1s+bhm": "poll 1 s + BaseHTTPMiddleware",
    "poll-0.1s+bhm": "poll 0.1 s + BaseHTTPMiddleware",
    # Starlette listens for the disconnect itself while the server advertises ASGI spec < 2.4.
    "streaming": "StreamingResponse alone",
    "baseline-py312": "no middleware (3.12)",
    "asgi-cancel-py312": "asgi-cancel (3.12)",
    "fastapi-disconnect": "fastapi-disconnect middleware",
    "fastapi-disconnect-decorator": "fastapi-disconnect @cancel_on_disconnect",
    # Reference, not an alternative: what any middleware layer costs, whatever it does.
    "passthrough": "do-nothing ASGI middleware (reference)",
    "raw-baseline": "bare ASGI app",
    "raw-passthrough": "bare ASGI app + do-nothing middleware",
    "raw-asgi-cancel": "bare ASGI app + asgi-cancel",
    "floor": "app listens itself (floor)",
}
# fastapi-disconnect needs Python >= 3.12: these run in their own venv.
PY312_VARIANTS = {v for v in VARIANTS if "py312" in v or v.startswith("fastapi-disconnect")}


def python(variant: str) -> str:
    return str(PY312) if variant in PY312_VARIANTS else sys.executable


def runnable(variants: list[str], skipped: dict[str, str]) -> list[str]:
    """`variants` less the 3.12 ones when their venv is missing (and `skipped` says so)."""
    probe = [str(PY312), "-c", "import fastapi_disconnect, fastapi, uvicorn, hypercorn"]
    if PY312.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return variants
    skipped["the Python 3.12 columns"] = f"no fastapi-disconnect venv at {PY312} (see the docs)"
    return [variant for variant in variants if variant not in PY312_VARIANTS]


class TokenGenerator:
    """The wasted-work benchmark's engine, continuous batching in miniature: a request gets
    `tokens` tokens, one every `step` seconds, once one of `batch` slots is free (first come,
    first served), each timestamped; as in vLLM's `generate()`, a cancelled request (or closed
    stream) is aborted and frees its slot at once."""

    def __init__(self, step: float, batch: int) -> None:
        self.step = step
        self.slots = asyncio.Semaphore(batch)
        self.requests: dict[int, dict[str, Any]] = {}

    async def generate(self, request_id: int, tokens: int) -> AsyncIterator[int]:
        request: dict[str, Any] = {"token_times": [], "end": None}
        self.requests[request_id] = request
        try:
            async with self.slots:
                for token in range(tokens):
                    await asyncio.sleep(self.step)
                    request["token_times"].append(time.monotonic())
                    yield token
            request["end"] = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            request["end"] = "aborted"
            raise


# -- the alternatives, as their users write them ---------------------------------------------
def with_cancellation(handler: Handler) -> Handler:
    """vLLM's decorator (same logic, own words): race the handler with a disconnect listener;
    the loser is cancelled (not awaited); None when the disconnect wins."""

    async def listen_for_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        listener = asyncio.create_task(listen_for_disconnect(kwargs["raw_request"]))
        done, pending = await asyncio.wait(
            [handler_task, listener], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        return handler_task.result() if handler_task in done else None

    return wrapper


def cancel_on_disconnect_polling(interval: float) -> Callable[[Handler], Handler]:
    """The polling decorator users copy from FastAPI discussion 8805 (the msdrigg gists)."""

    async def disconnect_poller(request: Request) -> None:
        while not await request.is_disconnected():  # noqa: ASYNC110 - polling is the point
            await asyncio.sleep(interval)

    def decorator(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            poller = asyncio.ensure_future(disconnect_poller(kwargs["raw_request"]))
            handler_task = asyncio.ensure_future(handler(*args, **kwargs))
            done, pending = await asyncio.wait(
                [poller, handler_task], return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            return await handler_task if handler_task in done else Response(status_code=499)

        return wrapper

    return decorator


async def _pass_through(request: Request, call_next: RequestResponseEndpoint) -> Response:
    return await call_next(request)


class PassThroughMiddleware:
    """The cheapest possible pure ASGI middleware: the price of one more layer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


# -- building one app ------------------------------------------------------------------------
def build(
    variant: str,
    scenario: str,
    *,
    hold: float = 3.0,
    record: Recorder = lambda request_id, event: None,
    engine: TokenGenerator | None = None,
) -> ASGIApp:
    if variant.startswith("raw-") or variant == "floor":
        return _raw_app(variant, scenario, hold, record)
    base = variant.removesuffix("-py312")
    guard: Callable[[Handler], Handler] | None = None
    if base == "vllm":
        guard = with_cancellation
    elif base.startswith("poll-"):
        guard = cancel_on_disconnect_polling(float(base[5:].split("s")[0]))
    elif base == "fastapi-disconnect-decorator":
        guard = importlib.import_module("fastapi_disconnect").cancel_on_disconnect
    streaming, needs_request = base == "streaming", base == "vllm" or base.startswith("poll-")
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    if scenario == "hello":
        path, handler = "/", _hello(streaming, needs_request)
    elif scenario == "slow":
        path, handler = "/slow", _handler(_slow(hold, record), streaming, needs_request)
    else:
        engine = engine or TokenGenerator(0.01, 16)
        path, handler = "/generate", _handler(engine.generate, streaming, needs_request)
        _engine_admin(app, engine)
    # response_model=None: no response validation (vLLM's handlers are unannotated), which
    # would also turn with_cancellation's None into a 500.
    app.add_api_route(path, handler if guard is None else guard(handler), response_model=None)
    if base.endswith("+bhm"):
        app.add_middleware(BaseHTTPMiddleware, dispatch=_pass_through)
    if base == "asgi-cancel":
        app.add_middleware(CancelOnDisconnectMiddleware)
    elif base == "passthrough":
        app.add_middleware(PassThroughMiddleware)
    elif base == "fastapi-disconnect":
        fastapi_disconnect = importlib.import_module("fastapi_disconnect")
        app.add_middleware(fastapi_disconnect.CancelOnDisconnectMiddleware)
    return app


def _hello(streaming: bool, needs_request: bool) -> Handler:
    async def hello_streaming() -> StreamingResponse:
        return StreamingResponse(iter([b'{"hello":"world"}']), media_type="application/json")

    async def hello_with_request(raw_request: Request) -> dict[str, str]:
        return {"hello": "world"}  # the decorators find the request in `raw_request`

    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    return hello_streaming if streaming else hello_with_request if needs_request else hello


Work = Callable[[int, int], AsyncIterator[int]]


def _slow(hold: float, record: Recorder) -> Work:
    async def work(request_id: int, tokens: int) -> AsyncIterator[int]:
        record(request_id, "start")
        try:
            await asyncio.sleep(hold)
        except asyncio.CancelledError:
            record(request_id, "cancelled")
            raise
        record(request_id, "completed")
        yield 0

    return work


def _handler(work: Work, streaming: bool, needs_request: bool) -> Handler:
    """`work`'s items streamed (`streaming`) or counted into one JSON answer."""

    async def streamed(id: int, tokens: int = 1) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            async for item in work(id, tokens):
                yield b"%d\n" % item

        return StreamingResponse(body(), media_type="text/plain")

    async def counted(id: int, tokens: int = 1) -> dict[str, int]:
        return {"id": id, "tokens": len([item async for item in work(id, tokens)])}

    async def counted_with_request(raw_request: Request, id: int, tokens: int = 1) -> Any:
        return await counted(id, tokens)

    return streamed if streaming else counted_with_request if needs_request else counted


def _engine_admin(app: FastAPI, engine: TokenGenerator) -> None:
    async def stats() -> dict[str, Any]:
        unfinished = sum(1 for request in engine.requests.values() if request["end"] is None)
        return {"unfinished": unfinished, "requests": engine.requests}

    async def reset() -> None:
        engine.requests.clear()

    app.add_api_route("/stats", stats, response_model=None)
    app.add_api_route("/reset", reset, response_model=None)


# -- bare ASGI apps --------------------------------------------------------------------------
_HELLO_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"17")]
_HELLO_START = {"type": "http.response.start", "status": 200, "headers": _HELLO_HEADERS}
_HELLO_BODY = {"type": "http.response.body", "body": b'{"hello":"world"}'}


def _raw_app(variant: str, scenario: str, hold: float, record: Recorder) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        if variant == "floor" or scenario == "slow":
            request_id = int(scope["query_string"].partition(b"id=")[2].split(b"&")[0])
            record(request_id, "start")
            if variant == "floor":
                while (await receive())["type"] != "http.disconnect":  # the server's own delivery
                    pass
                record(request_id, "cancelled")
                return
            await asyncio.sleep(hold)
            record(request_id, "completed")
        await send(dict(_HELLO_START))
        await send(dict(_HELLO_BODY))

    if variant == "raw-asgi-cancel":
        return CancelOnDisconnectMiddleware(app)
    if variant == "raw-passthrough":
        return PassThroughMiddleware(app)
    return app
