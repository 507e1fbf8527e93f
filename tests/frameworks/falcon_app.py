"""A Falcon ASGI app: `app = CancelOnDisconnectMiddleware(falcon.asgi.App())`."""

from __future__ import annotations

import falcon
import falcon.asgi

from .appkit import NORMAL_BODY, NORMAL_HEADER, chunks, served, slow_work


class Matrix:
    """One resource, a responder per route (`add_route(..., suffix=name)`: `on_get_<name>`)."""

    async def on_get_hello(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "hello"

    async def on_get_normal(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.set_header(*NORMAL_HEADER)
        resp.text = NORMAL_BODY

    async def on_get_slow(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await slow_work(req.get_param("id", required=True), req.get_param_as_float("t") or 30)
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "slow done"

    async def on_get_sse(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        rid, seconds = req.get_param("id", required=True), req.get_param_as_float("t") or 30
        resp.sse = chunks(rid, seconds, wrap=lambda chunk: falcon.asgi.SSEvent(data=chunk))


falcon_app = falcon.asgi.App()
for route in ("hello", "normal", "slow", "sse"):
    falcon_app.add_route(f"/{route}", Matrix(), suffix=route)

app = served(falcon_app, wrap=True)
control = served(falcon_app)
