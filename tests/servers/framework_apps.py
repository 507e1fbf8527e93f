"""Starlette and FastAPI apps with `app.add_middleware(CancelOnDisconnectMiddleware)`.

Served together by one uvicorn as `servers.framework_apps:app`; the first path segment picks
the app (`/starlette/...`, `/basehttp/...`, `/fastapi/...`), the routes carry it too, and
nothing rewrites the scope. Each app has `/<app>/slow`, `/<app>/stream` (StreamingResponse),
`/<app>/bg` (a background task after the response) and `/<app>/hello`; FastAPI also has
`/fastapi/sync`, a sync `def` endpoint that runs in the threadpool and polls the token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import BackgroundTasks, FastAPI, Query
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token

from .events import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    log_cancellations_to_stderr,
    record,
    record_hook,
    recording_exit,
    serve_lifespan,
)

CHUNK = b"chunk\n"
CHUNK_INTERVAL = 0.02
BACKGROUND_WORK = 0.3


def record_cancelled(rid: str, token: CancelToken, exc: BaseException | None) -> None:
    record(
        rid,
        "cancelled",
        exc="none" if exc is None else type(exc).__name__,
        token_cancelled=token.cancelled,
        reason=token.reason,
    )


async def slow_work(rid: str, seconds: float) -> None:
    token = current_token()
    record(rid, "start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        raise
    record(rid, "done")


async def chunks(rid: str) -> AsyncIterator[bytes]:
    token = current_token()
    record(rid, "start")
    try:
        for _ in range(int(30 / CHUNK_INTERVAL)):
            yield CHUNK
            await asyncio.sleep(CHUNK_INTERVAL)
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        raise
    record(rid, "done")


async def background_work(rid: str) -> None:
    await asyncio.sleep(BACKGROUND_WORK)
    record(rid, "bg_done", token_cancelled=current_token().cancelled)


# -- Starlette ----------------------------------------------------------------------------------
async def starlette_slow(request: Request) -> Response:
    await slow_work(request.query_params["id"], float(request.query_params.get("t", "30")))
    return PlainTextResponse("slow done")


async def starlette_stream(request: Request) -> Response:
    return StreamingResponse(chunks(request.query_params["id"]), media_type="text/plain")


async def starlette_bg(request: Request) -> Response:
    rid = request.query_params["id"]
    record(rid, "start")
    return PlainTextResponse("bg", background=BackgroundTask(background_work, rid))


async def starlette_hello(request: Request) -> Response:
    return PlainTextResponse("hello")


def starlette_routes(prefix: str) -> list[Route]:
    return [
        Route(f"/{prefix}/slow", starlette_slow),
        Route(f"/{prefix}/stream", starlette_stream),
        Route(f"/{prefix}/bg", starlette_bg),
        Route(f"/{prefix}/hello", starlette_hello),
    ]


starlette_app = Starlette(routes=starlette_routes("starlette"))
starlette_app.add_middleware(CancelOnDisconnectMiddleware, on_cancelled=record_hook)


class PassThroughMiddleware(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        response.headers["x-passed-through"] = "1"
        return response


# BaseHTTPMiddleware inside ours: add_middleware wraps, so the last one added is outermost.
basehttp_app = Starlette(routes=starlette_routes("basehttp"))
basehttp_app.add_middleware(PassThroughMiddleware)
basehttp_app.add_middleware(CancelOnDisconnectMiddleware, on_cancelled=record_hook)


# -- FastAPI --------------------------------------------------------------------------------------
fastapi_app = FastAPI()
fastapi_app.add_middleware(CancelOnDisconnectMiddleware, on_cancelled=record_hook)
RequestId = Annotated[str, Query(alias="id")]


@fastapi_app.get("/fastapi/slow")
async def fastapi_slow(rid: RequestId, t: float = 30) -> PlainTextResponse:
    await slow_work(rid, t)
    return PlainTextResponse("slow done")


@fastapi_app.get("/fastapi/stream")
async def fastapi_stream(rid: RequestId) -> StreamingResponse:
    return StreamingResponse(chunks(rid), media_type="text/plain")


@fastapi_app.get("/fastapi/bg")
async def fastapi_bg(rid: RequestId, background_tasks: BackgroundTasks) -> PlainTextResponse:
    record(rid, "start")
    background_tasks.add_task(background_work, rid)
    return PlainTextResponse("bg")


@fastapi_app.get("/fastapi/hello")
async def fastapi_hello() -> PlainTextResponse:
    return PlainTextResponse("hello")


@fastapi_app.get("/fastapi/sync")
def fastapi_sync(rid: RequestId, mode: str) -> PlainTextResponse:
    # A sync endpoint: FastAPI runs it in the threadpool, which the event loop cannot
    # interrupt; it stops itself by polling the token between units of work.
    token = current_token()
    record(rid, "start")
    try:
        for _ in range(3000):
            time.sleep(0.01)  # a unit of blocking work
            if mode == "raise":
                token.raise_if_cancelled()
            elif token.cancelled:
                record_cancelled(rid, token, None)
                return PlainTextResponse("stopped")
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        raise
    record(rid, "done")
    return PlainTextResponse("sync done")


# -- one server for all three ---------------------------------------------------------------------
APPS: dict[str, ASGIApp] = {
    "starlette": starlette_app,
    "basehttp": basehttp_app,
    "fastapi": fastapi_app,
}


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("hello")(scope, receive, send)


async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    prefix = scope["path"].split("/")[1]
    await APPS.get(prefix, hello)(scope, receive, send)


log_cancellations_to_stderr()
app = recording_exit(dispatch)
