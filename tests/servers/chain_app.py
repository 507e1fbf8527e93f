"""A two-hop chain for the cancel-across-hops tests: a gateway (Starlette + httpx) in front of a
backend (a raw ASGI app under the middleware), each in its own uvicorn process.

- `chain_app:backend`: `/slow?id=` sleeps 30 s, `/stream?id=` sends a chunk every 20 ms for
  30 s; both record `started` and, when the middleware cancels them, `cancelled`.
- `chain_app:gateway`: `CancelOnDisconnectMiddleware` + `CancelTransport` (the binding);
  `chain_app:gateway_plain`: neither (the control); `chain_app:gateway_middleware_only`: the
  middleware with a plain httpx client. `/slow` and `/stream` proxy to the backend on port
  `$CHAIN_BACKEND_PORT`, non-streaming (the whole body, then answer) and streaming.
"""

from __future__ import annotations

import asyncio
import os

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token
from asgi_cancel.httpx import CancelTransport

from .events import Receive, Scope, Send, query_param, record, request_id, serve_lifespan


async def _backend(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    path, rid = scope["path"], request_id(scope)
    if path == "/hello":
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})
        return
    record(rid, "started", upstream_id=current_token().request_id or "")
    try:
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(1500):
                await send({"type": "http.response.body", "body": b"chunk\n", "more_body": True})
                await asyncio.sleep(0.02)
            await send({"type": "http.response.body", "body": b""})
        else:
            await asyncio.sleep(float(query_param(scope, "t", "30")))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"slow done"})
    except asyncio.CancelledError:
        record(rid, "cancelled")
        raise
    record(rid, "finished")


backend = CancelOnDisconnectMiddleware(_backend, registry=CancelRegistry())


def _gateway(client: httpx.AsyncClient) -> Starlette:
    upstream = f"http://127.0.0.1:{os.environ.get('CHAIN_BACKEND_PORT', '0')}"

    async def hello(request: Request) -> Response:
        return PlainTextResponse("hello")

    async def slow(request: Request) -> Response:
        answer = await client.get(f"{upstream}/slow", params=request.query_params)
        return Response(answer.content, status_code=answer.status_code)

    async def stream(request: Request) -> Response:
        outgoing = client.build_request("GET", f"{upstream}/stream", params=request.query_params)
        answer = await client.send(outgoing, stream=True)
        return StreamingResponse(answer.aiter_raw(), background=BackgroundTask(answer.aclose))

    routes = [Route("/hello", hello), Route("/slow", slow), Route("/stream", stream)]
    return Starlette(routes=routes)


_TIMEOUT = httpx.Timeout(60.0)
gateway = CancelOnDisconnectMiddleware(
    _gateway(
        httpx.AsyncClient(transport=CancelTransport(forward_to=["127.0.0.1"]), timeout=_TIMEOUT)
    ),
    registry=CancelRegistry(),
)
gateway_plain = _gateway(httpx.AsyncClient(timeout=_TIMEOUT))
gateway_middleware_only = CancelOnDisconnectMiddleware(
    _gateway(httpx.AsyncClient(timeout=_TIMEOUT))
)
