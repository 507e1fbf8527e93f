"""A Quart app wrapped with the middleware, served by hypercorn as `servers.quart_app:app`."""

from __future__ import annotations

import asyncio

from quart import Quart, request

from asgi_cancel import CancelOnDisconnectMiddleware, current_token

from .events import log_cancellations_to_stderr, record, record_hook, recording_exit

quart = Quart(__name__)


@quart.get("/hello")
async def hello() -> str:
    return "hello"


@quart.get("/quart/slow")
async def slow() -> str:
    rid = request.args["id"]
    token = current_token()
    record(rid, "start")
    try:
        await asyncio.sleep(float(request.args.get("t", "30")))
    except asyncio.CancelledError as exc:
        record(
            rid,
            "cancelled",
            exc=type(exc).__name__,
            token_cancelled=token.cancelled,
            reason=token.reason,
        )
        raise
    record(rid, "done")
    return "slow done"


log_cancellations_to_stderr()
# No cast needed: the middleware accepts apps typed with their own scope TypedDicts.
app = recording_exit(CancelOnDisconnectMiddleware(quart, on_cancelled=record_hook))
