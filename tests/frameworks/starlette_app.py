"""A Starlette app: `app.add_middleware(CancelOnDisconnectMiddleware)`; `control` without it.

`basehttp_app.py` is the same with a `BaseHTTPMiddleware` inside ours.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from asgi_cancel import CancelOnDisconnectMiddleware

from ..servers.events import record_hook
from .appkit import (
    NORMAL_BODY,
    NORMAL_HEADER,
    background_work,
    chunks,
    echoing,
    served,
    slow_work,
    ticking,
)


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def normal(request: Request) -> Response:
    return PlainTextResponse(NORMAL_BODY, headers=dict([NORMAL_HEADER]))


async def slow(request: Request) -> Response:
    await slow_work(request.query_params["id"], float(request.query_params.get("t", "30")))
    return PlainTextResponse("slow done")


async def stream(request: Request) -> Response:
    body = chunks(request.query_params["id"], float(request.query_params.get("t", "30")))
    return StreamingResponse(body, media_type="text/plain")


async def bg(request: Request) -> Response:
    return PlainTextResponse(
        "bg", background=BackgroundTask(background_work, request.query_params["id"])
    )


async def ws_busy(websocket: WebSocket) -> None:
    await websocket.accept()
    rid, seconds = websocket.query_params["id"], float(websocket.query_params.get("t", "30"))
    await ticking(rid, seconds, websocket.send_text)


async def ws_chat(websocket: WebSocket) -> None:
    await websocket.accept()
    rid = websocket.query_params["id"]
    await echoing(rid, websocket.receive_text, websocket.send_text, (WebSocketDisconnect,))


ROUTES = [
    *(Route(f"/{e.__name__}", e) for e in (hello, normal, slow, stream, bg)),
    WebSocketRoute("/ws/busy", ws_busy),
    WebSocketRoute("/ws/chat", ws_chat),
]


def build(*middleware: Middleware, cancel: bool) -> Starlette:
    app = Starlette(routes=ROUTES, middleware=list(middleware))
    if cancel:  # add_middleware wraps: the last one added is the outermost
        app.add_middleware(CancelOnDisconnectMiddleware, on_cancelled=record_hook)
    return app


app = served(build(cancel=True))
control = served(build(cancel=False))
