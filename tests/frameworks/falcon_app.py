"""A Falcon ASGI app: `app = CancelOnDisconnectMiddleware(falcon.asgi.App())`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import falcon
import falcon.asgi

from .appkit import (
    CHUNK_INTERVAL,
    NORMAL_BODY,
    NORMAL_HEADER,
    as_asgi,
    is_cancelled,
    log_cancellations_to_stderr,
    record,
    record_cancelled,
    recording_exit,
    slow_work,
    token_or_none,
    with_middleware,
)


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


async def events(rid: str, seconds: float) -> AsyncIterator[falcon.asgi.SSEvent]:
    token = token_or_none()
    record(rid, "start")
    try:
        for _ in range(int(seconds / CHUNK_INTERVAL)):
            yield falcon.asgi.SSEvent(data=b"chunk\n")
            await asyncio.sleep(CHUNK_INTERVAL)
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        raise
    except GeneratorExit:
        record(rid, "closed_by_framework", token_cancelled=is_cancelled(token))
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


class Events:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.sse = events(req.get_param("id", required=True), req.get_param_as_float("t") or 30)


falcon_app = falcon.asgi.App()
falcon_app.add_route("/hello", Hello())
falcon_app.add_route("/normal", Normal())
falcon_app.add_route("/slow", Slow())
falcon_app.add_route("/sse", Events())

log_cancellations_to_stderr()
app = recording_exit(with_middleware(falcon_app))
control = recording_exit(as_asgi(falcon_app))
