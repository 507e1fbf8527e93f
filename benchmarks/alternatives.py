"""Every way a user gets "stop the work when the client leaves", written as its users write it.

Each variant builds the same FastAPI app for a scenario:

- `hello`: `GET /` returns `{"hello": "world"}` (overhead).
- `slow`: `GET /slow?id=N` holds for `hold` seconds; records when its work is cancelled (latency,
  memory).
- `engine`: `GET /generate?id=N&tokens=T` runs a request on example_app's simulated engine
  and returns the token count (wasted work); `/stats` and `/reset` serve the harness.

The variants:

- `baseline`: no cancellation at all.
- `asgi-cancel`: `app.add_middleware(CancelOnDisconnectMiddleware)`, handlers unchanged.
- `vllm`: vLLM's `@with_cancellation` (vllm/entrypoints/.../api_utils.py): a handler task and a
  listener task that reads `request.receive()` until `http.disconnect`, raced with
  `asyncio.wait(FIRST_COMPLETED)`; the loser is cancelled; returns None when the disconnect wins.
- `poll-1s`, `poll-0.1s`: the polling decorator from FastAPI discussion 8805 (the
  msdrigg/benoit-cty gists): a handler task and a poller task running
  `while not await request.is_disconnected(): await asyncio.sleep(interval)`.
- `poll-*+bhm`: the same with a pass-through `BaseHTTPMiddleware` in the stack, as in any app
  with a `@app.middleware("http")` for logging or headers.
- `streaming`: Starlette's `StreamingResponse` alone; it listens for the disconnect itself while
  the server advertises ASGI spec < 2.4 (uvicorn 2.3, hypercorn 2.1), and cancels the body
  iteration only.
- `fastapi-disconnect`, `fastapi-disconnect-decorator`: the PyPI package (Python >= 3.12), its
  middleware and its `@cancel_on_disconnect` decorator.
- `raw-baseline`, `raw-asgi-cancel`: a bare ASGI hello world without and with the middleware,
  the worst case for relative overhead.
- `passthrough`, `raw-passthrough` (reference, not an alternative): a pure ASGI middleware that
  only calls the app: what any middleware layer costs, whatever it does.
- `floor` (`slow` only): a bare ASGI app that listens for `http.disconnect` itself: the server's
  own delivery time, which no middleware can beat.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.types import ASGIApp, Receive, Scope, Send
from example_app.sim_engine import SimParams, SimulatedEngine

Recorder = Callable[[int, str], None]
Handler = Callable[..., Coroutine[Any, Any, Any]]


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    python: str  # "3.11" (the dev venv) or "3.12" (fastapi-disconnect's own venv)
    watches_request: bool  # watches the whole request, not only a response stream
    scenarios: frozenset[str]


_ALL = frozenset({"hello", "slow", "engine"})
VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("baseline", "no middleware", "3.11", False, _ALL),
        Variant("asgi-cancel", "asgi-cancel", "3.11", True, _ALL),
        Variant("vllm", "vLLM @with_cancellation", "3.11", True, _ALL),
        Variant("poll-1s", "poll is_disconnected 1 s", "3.11", True, _ALL),
        Variant("poll-0.1s", "poll is_disconnected 0.1 s", "3.11", True, _ALL),
        Variant("poll-1s+bhm", "poll 1 s + BaseHTTPMiddleware", "3.11", True, _ALL),
        Variant("poll-0.1s+bhm", "poll 0.1 s + BaseHTTPMiddleware", "3.11", True, _ALL),
        Variant("streaming", "StreamingResponse alone", "3.11", False, _ALL),
        Variant("baseline-py312", "no middleware (3.12)", "3.12", False, _ALL),
        Variant("asgi-cancel-py312", "asgi-cancel (3.12)", "3.12", True, _ALL),
        Variant("fastapi-disconnect", "fastapi-disconnect middleware", "3.12", True, _ALL),
        Variant(
            "fastapi-disconnect-decorator",
            "fastapi-disconnect @cancel_on_disconnect",
            "3.12",
            True,
            _ALL,
        ),
        Variant("passthrough", "do-nothing ASGI middleware (reference)", "3.11", False, _ALL),
        Variant("raw-baseline", "bare ASGI app", "3.11", False, frozenset({"hello", "slow"})),
        Variant(
            "raw-passthrough",
            "bare ASGI app + do-nothing middleware",
            "3.11",
            False,
            frozenset({"hello"}),
        ),
        Variant(
            "raw-asgi-cancel", "bare ASGI app + asgi-cancel", "3.11", True, frozenset({"hello"})
        ),
        Variant("floor", "app listens itself (floor)", "3.11", True, frozenset({"slow"})),
    )
}


def _noop_record(request_id: int, event: str) -> None:
    pass


# -- the alternatives, as their users write them ---------------------------------------------
def with_cancellation(handler: Handler) -> Handler:
    """vLLM's decorator (same logic, own words): race the handler with a disconnect listener."""

    async def listen_for_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = args[1] if len(args) > 1 else kwargs["raw_request"]
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        cancellation_task = asyncio.create_task(listen_for_disconnect(request))
        done, pending = await asyncio.wait(
            [handler_task, cancellation_task], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if handler_task in done:
            return handler_task.result()
        return None

    return wrapper


def cancel_on_disconnect_polling(interval: float) -> Callable[[Handler], Handler]:
    """The polling decorator users copy from FastAPI discussion 8805."""

    async def disconnect_poller(request: Request) -> None:
        # Polling is the point of this alternative, as users write it.
        while not await request.is_disconnected():  # noqa: ASYNC110
            await asyncio.sleep(interval)

    def decorator(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            request: Request = kwargs["raw_request"]
            poller_task = asyncio.ensure_future(disconnect_poller(request))
            handler_task = asyncio.ensure_future(handler(*args, **kwargs))
            done, pending = await asyncio.wait(
                [poller_task, handler_task], return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            if handler_task in done:
                return await handler_task
            return Response(status_code=499)

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


def _fastapi_disconnect() -> Any:
    return importlib.import_module("fastapi_disconnect")


# -- building one app ------------------------------------------------------------------------
def build(
    variant: str,
    scenario: str,
    *,
    hold: float = 3.0,
    record: Recorder = _noop_record,
    engine: SimulatedEngine | None = None,
) -> ASGIApp:
    spec = VARIANTS[variant]
    if scenario not in spec.scenarios:
        raise ValueError(f"variant {variant!r} has no {scenario!r} scenario")
    if variant.startswith("raw-") or variant == "floor":
        return _raw_app(variant, scenario, hold=hold, record=record)

    guard: Callable[[Handler], Handler] | None = None
    needs_request = False
    base = variant.removesuffix("-py312")
    if base == "vllm":
        guard, needs_request = with_cancellation, True
    elif base.startswith("poll-"):
        interval = float(base.split("-")[1].split("s")[0])
        guard, needs_request = cancel_on_disconnect_polling(interval), True
    elif base == "fastapi-disconnect-decorator":
        guard = _fastapi_disconnect().cancel_on_disconnect
    streaming = base == "streaming"

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    if scenario == "hello":
        handler = _hello(streaming, needs_request)
        path = "/"
    elif scenario == "slow":
        handler = _slow(streaming, needs_request, hold, record)
        path = "/slow"
    else:
        if engine is None:
            engine = simulated_engine()
        handler = _generate(streaming, needs_request, engine)
        path = "/generate"
        _engine_admin(app, engine)
    if guard is not None:
        handler = guard(handler)
    # response_model=None: as an unannotated handler (vLLM's are): no response validation,
    # which would also turn with_cancellation's None into a 500.
    app.add_api_route(path, handler, methods=["GET"], response_model=None)

    if base.endswith("+bhm"):
        app.add_middleware(BaseHTTPMiddleware, dispatch=_pass_through)
    if base == "asgi-cancel":
        app.add_middleware(CancelOnDisconnectMiddleware)
    elif base == "passthrough":
        app.add_middleware(PassThroughMiddleware)
    elif base == "fastapi-disconnect":
        app.add_middleware(_fastapi_disconnect().CancelOnDisconnectMiddleware)
    return app


def _hello(streaming: bool, needs_request: bool) -> Handler:
    if streaming:

        async def hello_streaming() -> StreamingResponse:
            return StreamingResponse(iter([b'{"hello":"world"}']), media_type="application/json")

        return hello_streaming
    if needs_request:

        async def hello_with_request(raw_request: Request) -> dict[str, str]:
            return {"hello": "world"}

        return hello_with_request

    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    return hello


def _slow(streaming: bool, needs_request: bool, hold: float, record: Recorder) -> Handler:
    async def work(request_id: int) -> None:
        record(request_id, "start")
        try:
            await asyncio.sleep(hold)
        except asyncio.CancelledError:
            record(request_id, "cancelled")
            raise
        record(request_id, "completed")

    if streaming:

        async def slow_streaming(id: int) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                await work(id)
                yield b'{"done":true}'

            return StreamingResponse(body(), media_type="application/json")

        return slow_streaming
    if needs_request:

        async def slow_with_request(id: int, raw_request: Request) -> dict[str, int]:
            await work(id)
            return {"id": id}

        return slow_with_request

    async def slow(id: int) -> dict[str, int]:
        await work(id)
        return {"id": id}

    return slow


def simulated_engine(step_time: float = 0.01, max_batch: int = 16) -> SimulatedEngine:
    """example_app's engine, keeping the per-token times the waste benchmark counts from."""
    return SimulatedEngine(step_time=step_time, max_batch_size=max_batch, keep_timelines=True)


async def _tokens(engine: SimulatedEngine, id: int, tokens: int) -> AsyncIterator[int]:
    """Token numbers 0..tokens-1 of request `id` as the engine produces them."""
    await engine.start()
    sent = 0
    params = SimParams(max_tokens=tokens, seed=id)
    # Closed with the caller (a streaming body closed early), as vLLM's generator would be.
    async with aclosing(engine.generate("", params, str(id))) as outputs:
        async for output in outputs:
            produced = len(output.outputs[0].token_ids)
            for token in range(sent, produced):
                yield token
            sent = produced


def _generate(streaming: bool, needs_request: bool, engine: SimulatedEngine) -> Handler:
    if streaming:

        async def generate_streaming(id: int, tokens: int) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                async for token in _tokens(engine, id, tokens):
                    yield b"%d\n" % token

            return StreamingResponse(body(), media_type="text/plain")

        return generate_streaming

    async def run(id: int, tokens: int) -> dict[str, int]:
        count = 0
        async for _token in _tokens(engine, id, tokens):
            count += 1
        return {"id": id, "tokens": count}

    if needs_request:

        async def generate_with_request(id: int, tokens: int, raw_request: Request) -> Any:
            return await run(id, tokens)

        return generate_with_request

    async def generate(id: int, tokens: int) -> dict[str, int]:
        return await run(id, tokens)

    return generate


def _engine_admin(app: FastAPI, engine: SimulatedEngine) -> None:
    async def stats() -> JSONResponse:
        engine_stats = engine.stats()
        return JSONResponse(
            {
                "steps": engine.steps,
                "unfinished": engine_stats.running + engine_stats.waiting,
                "requests": [
                    {"id": request_id, **asdict(timeline)}
                    for request_id, timeline in engine.timelines.items()
                ],
            }
        )

    async def reset() -> dict[str, bool]:
        engine.reset()
        return {"ok": True}

    app.add_api_route("/stats", stats, methods=["GET"], response_model=None)
    app.add_api_route("/reset", reset, methods=["GET"], response_model=None)


# -- bare ASGI apps --------------------------------------------------------------------------
_HELLO_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"17")],
}
_HELLO_BODY = {"type": "http.response.body", "body": b'{"hello":"world"}'}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _raw_app(variant: str, scenario: str, *, hold: float, record: Recorder) -> ASGIApp:
    async def hello(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        await send(dict(_HELLO_START))
        await send(dict(_HELLO_BODY))

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        request_id = _request_id(scope)
        record(request_id, "start")
        await asyncio.sleep(hold)
        record(request_id, "completed")
        await send(dict(_HELLO_START))
        await send(dict(_HELLO_BODY))

    async def floor(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        request_id = _request_id(scope)
        record(request_id, "start")
        while True:  # body, then the disconnect: the server's own delivery
            message = await receive()
            if message["type"] == "http.disconnect":
                record(request_id, "cancelled")
                return

    if variant == "floor":
        return floor
    app = hello if scenario == "hello" else slow
    if variant == "raw-asgi-cancel":
        return CancelOnDisconnectMiddleware(app)
    if variant == "raw-passthrough":
        return PassThroughMiddleware(app)
    return app


def _request_id(scope: Scope) -> int:
    for part in scope.get("query_string", b"").split(b"&"):
        if part.startswith(b"id="):
            return int(part[3:])
    return -1
