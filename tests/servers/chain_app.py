"""A two-hop chain: a gateway (Starlette + httpx) in front of a backend, each its own process.

- `backend`: the probe app under the middleware with a registry (it reports the request's
  `X-Request-Id` in its `start` event).
- `gateway`: the middleware + `CancelTransport` (the binding), forwarding ids to 127.0.0.1;
  `gateway_aiohttp`: the same with an aiohttp session and `cancel_trace_config` (its upstream
  call runs in a task of its own, which only the binding can stop);
  `gateway_middleware_only`: the middleware with a plain httpx client; `gateway_plain`: no
  asgi-cancel at all (the control). `/slow` and `/stream` proxy to the backend on port
  `$CHAIN_BACKEND_PORT`: the whole body, then answer; or streamed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import aiohttp
import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry
from asgi_cancel.aiohttp import cancel_trace_config
from asgi_cancel.httpx import CancelTransport

from .events import record_hook, recording_exit
from .probe_app import probe

backend = recording_exit(
    CancelOnDisconnectMiddleware(probe, on_cancelled=record_hook, registry=CancelRegistry())
)


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
_BINDING = CancelTransport(forward_to=["127.0.0.1"])
gateway = CancelOnDisconnectMiddleware(
    _gateway(httpx.AsyncClient(transport=_BINDING, timeout=_TIMEOUT)), registry=CancelRegistry()
)
gateway_middleware_only = CancelOnDisconnectMiddleware(
    _gateway(httpx.AsyncClient(timeout=_TIMEOUT))
)
gateway_plain = _gateway(httpx.AsyncClient(timeout=_TIMEOUT))


def _aiohttp_gateway() -> Starlette:
    upstream = f"http://127.0.0.1:{os.environ.get('CHAIN_BACKEND_PORT', '0')}"
    sessions: list[aiohttp.ClientSession] = []

    def session() -> aiohttp.ClientSession:  # made in the server's event loop
        if not sessions:
            config = cancel_trace_config(forward_to=["127.0.0.1"])
            sessions.append(aiohttp.ClientSession(trace_configs=[config]))
        return sessions[0]

    async def hello(request: Request) -> Response:
        return PlainTextResponse("hello")

    async def slow(request: Request) -> Response:
        async def call() -> bytes:
            params = dict(request.query_params)
            async with session().get(f"{upstream}/slow", params=params) as answer:
                return await answer.read()

        # In a task of its own, as a gateway fanning out would: the binding stops it.
        body = await asyncio.get_running_loop().create_task(call())
        return Response(body)

    async def stream(request: Request) -> Response:
        answer = await session().get(f"{upstream}/stream", params=dict(request.query_params))

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in answer.content.iter_any():
                yield chunk

        return StreamingResponse(chunks(), background=BackgroundTask(answer.release))

    routes = [Route("/hello", hello), Route("/slow", slow), Route("/stream", stream)]
    return Starlette(routes=routes)


gateway_aiohttp = CancelOnDisconnectMiddleware(_aiohttp_gateway(), registry=CancelRegistry())
