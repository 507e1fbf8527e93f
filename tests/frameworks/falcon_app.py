"""A Falcon ASGI app: `app = CancelOnDisconnectMiddleware(falcon.asgi.App())`."""

from __future__ import annotations

import falcon
import falcon.asgi

from .appkit import NORMAL_BODY, NORMAL_HEADER, chunks, served, slow_work


class Hello:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "hello"


class Normal:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.set_header(*NORMAL_HEADER)
        resp.text = NORMAL_BODY


class Slow:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await slow_work(req.get_param("id", required=True), req.get_param_as_float("t") or 30)
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "slow done"


class Events:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        rid, seconds = req.get_param("id", required=True), req.get_param_as_float("t") or 30
        resp.sse = chunks(rid, seconds, wrap=lambda chunk: falcon.asgi.SSEvent(data=chunk))


falcon_app = falcon.asgi.App()
falcon_app.add_route("/hello", Hello())
falcon_app.add_route("/normal", Normal())
falcon_app.add_route("/slow", Slow())
falcon_app.add_route("/sse", Events())

app = served(falcon_app, wrap=True)
control = served(falcon_app)
