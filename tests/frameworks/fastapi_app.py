"""A FastAPI app: `app.add_middleware(CancelOnDisconnectMiddleware)`; `control` without it.

Both are built by one function, so the routes are the same; the query parameter `id` names
the request in the events.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from asgiref.sync import async_to_sync, sync_to_async
from fastapi import BackgroundTasks, Depends, FastAPI, Query, WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse, StreamingResponse
from sse_starlette import EventSourceResponse

from asgi_cancel import CancelOnDisconnectMiddleware

from ..servers.events import record, record_hook
from .appkit import (
    NORMAL_BODY,
    NORMAL_HEADER,
    Resource,
    background_work,
    blocking_work,
    chunks,
    echoing,
    polling_async_work,
    resource_dependency,
    served,
    slow_work,
    ticking,
)

RequestId = Annotated[str, Query(alias="id")]


def get_db(rid: RequestId) -> Iterator[Resource]:
    yield from resource_dependency(rid)


Db = Annotated[Resource, Depends(get_db)]


def build() -> FastAPI:
    api = FastAPI()

    @api.get("/hello")
    async def hello() -> PlainTextResponse:
        return PlainTextResponse("hello")

    @api.get("/normal")
    async def normal() -> PlainTextResponse:
        return PlainTextResponse(NORMAL_BODY, headers=dict([NORMAL_HEADER]))

    @api.get("/slow")
    async def slow(rid: RequestId, t: float = 30) -> PlainTextResponse:
        await slow_work(rid, t)
        return PlainTextResponse("slow done")

    @api.get("/stream")
    async def stream(rid: RequestId, t: float = 30) -> StreamingResponse:
        return StreamingResponse(chunks(rid, t), media_type="text/plain")

    @api.get("/sse")
    async def sse(rid: RequestId, t: float = 30) -> EventSourceResponse:
        events = chunks(rid, t, wrap=lambda chunk: chunk.decode().strip())
        return EventSourceResponse(events, sep="\n")  # `data: chunk\n\n`, not \r\n

    @api.get("/sync-db")
    def sync_db(rid: RequestId, db: Db, t: float = 30, check: str = "flag") -> PlainTextResponse:
        """A `def` endpoint: FastAPI runs it in the threadpool; the teardown of `db` must wait
        until it returned."""
        return PlainTextResponse(blocking_work(rid, t, db, check))

    @api.get("/async-db")
    async def async_db(rid: RequestId, db: Db, t: float = 30) -> PlainTextResponse:
        await slow_work(rid, t, resource=db)
        return PlainTextResponse("async done")

    @api.get("/bg")
    async def bg(rid: RequestId, background_tasks: BackgroundTasks) -> PlainTextResponse:
        background_tasks.add_task(background_work, rid)
        return PlainTextResponse("bg")

    @api.get("/sync-to-async")
    async def via_sync_to_async(rid: RequestId, db: Db, t: float = 30) -> PlainTextResponse:
        """asgiref `sync_to_async`: the work runs in a thread; `db` is torn down after."""
        result = await sync_to_async(blocking_work, thread_sensitive=False)(rid, t, db)
        return PlainTextResponse(result)

    @api.get("/async-to-sync")
    def via_async_to_sync(rid: RequestId, t: float = 30) -> PlainTextResponse:
        """A `def` endpoint running a coroutine with asgiref `async_to_sync`: the coroutine
        runs on another event loop, out of reach of the request's task; it polls the token."""
        try:
            return PlainTextResponse(async_to_sync(polling_async_work)(rid, t))
        finally:
            record(rid, "thread_returned")

    @api.websocket("/ws/busy")
    async def ws_busy(websocket: WebSocket, rid: RequestId, t: float = 30) -> None:
        await websocket.accept()
        await ticking(rid, t, websocket.send_text)

    @api.websocket("/ws/chat")
    async def ws_chat(websocket: WebSocket, rid: RequestId) -> None:
        await websocket.accept()
        await echoing(rid, websocket.receive_text, websocket.send_text, (WebSocketDisconnect,))

    return api


fastapi_app = build()
fastapi_app.add_middleware(CancelOnDisconnectMiddleware, on_cancelled=record_hook)
app = served(fastapi_app)
control = served(build())
