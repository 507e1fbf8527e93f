"""A Quart app: `app = CancelOnDisconnectMiddleware(quart_app)`; `control` is Quart alone."""

from __future__ import annotations

from quart import Quart, Response, request, websocket

from .appkit import NORMAL_BODY, NORMAL_HEADER, chunks, echoing, served, slow_work, ticking

quart_app = Quart(__name__)


@quart_app.get("/hello")
async def hello() -> str:
    return "hello"


@quart_app.get("/normal")
async def normal() -> Response:
    return Response(NORMAL_BODY, content_type="text/plain", headers=dict([NORMAL_HEADER]))


@quart_app.get("/slow")
async def slow() -> str:
    """Sleeps; `?cleanup=S` awaits S seconds in its `except CancelledError` before re-raising."""
    args = request.args
    await slow_work(args["id"], float(args.get("t", "30")), float(args.get("cleanup", "0")))
    return "slow done"


@quart_app.get("/stream")
async def stream() -> Response:
    body = chunks(request.args["id"], float(request.args.get("t", "30")))
    return Response(body, content_type="text/plain")


@quart_app.websocket("/ws/busy")
async def ws_busy() -> None:
    await websocket.accept()
    await ticking(websocket.args["id"], float(websocket.args.get("t", "30")), websocket.send)


@quart_app.websocket("/ws/chat")
async def ws_chat() -> None:
    """Quart cancels the handler itself once its client left: `echoing` records a
    cancellation, no `disconnected`."""
    await websocket.accept()
    await echoing(websocket.args["id"], receive_text, websocket.send)


async def receive_text() -> str:
    data = await websocket.receive()
    return data if isinstance(data, str) else data.decode()


app = served(quart_app, wrap=True)
control = served(quart_app)
