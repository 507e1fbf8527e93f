"""A Starlette app with `asgi_cancel.prometheus` on a registry of its own, for real servers.

Served as `servers.metrics_app:app` (asyncio and trio servers alike):

- `/hello`: 200 "hello" at once (the runner's readiness probe).
- `/items/{item_id:int}`: sleeps 30 s before answering (cancelled before the response).
- `/stream/{name}`: a chunk every 20 ms for up to 30 s (cancelled mid-stream).
- `/payments/{n}`: excluded from cancellation by prefix; sleeps `CLEANUP` s, then answers.
- `/metrics`: the registry in Prometheus' text format.
- `/v1/requests/{id}/cancel` (POST): cancels a running request by its `X-Request-Id`.

Requests may carry `X-Request-Timeout` (a deadline) and `X-Request-Id`.

Each cancelled endpoint spends `CLEANUP` seconds in its cleanup (shielded), which the
cleanup histogram must see.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, cancel_endpoint
from asgi_cancel.prometheus import CancelMetrics

CLEANUP = 0.2
registry = CollectorRegistry()


async def cleanup() -> None:
    with anyio.CancelScope(shield=True):
        await anyio.sleep(CLEANUP)


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def item(request: Request) -> Response:
    try:
        await anyio.sleep(30)
    finally:
        await cleanup()
    return PlainTextResponse("item")  # pragma: no cover


async def stream(request: Request) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        try:
            for _ in range(1500):
                yield b"chunk\n"
                await anyio.sleep(0.02)
        finally:
            await cleanup()

    return StreamingResponse(chunks(), media_type="text/plain")


async def payment(request: Request) -> Response:
    await anyio.sleep(CLEANUP)
    return PlainTextResponse("paid")


async def metrics(request: Request) -> Response:
    return Response(generate_latest(registry), media_type="text/plain")


cancel_registry = CancelRegistry()
routes = [
    Route("/hello", hello),
    Route("/items/{item_id:int}", item),
    Route("/stream/{name}", stream),
    Route("/payments/{n}", payment),
    Route("/metrics", metrics),
    Mount("/v1/requests", cancel_endpoint(cancel_registry, authorize=None)),  # test port only
]
app = CancelOnDisconnectMiddleware(
    Starlette(routes=routes),
    on_cancelled=CancelMetrics(registry=registry, namespace="test"),
    exclude=("/payments/", "/v1/requests/"),
    registry=cancel_registry,
    timeout_header="x-request-timeout",
)
