"""A Quart app: `app = CancelOnDisconnectMiddleware(quart_app)`; `control` is Quart alone."""

from __future__ import annotations

from quart import Quart, Response, request

from .appkit import NORMAL_BODY, NORMAL_HEADER, chunks, served, slow_work

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


app = served(quart_app, wrap=True)
control = served(quart_app)
