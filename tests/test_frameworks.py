"""Pass-through under Starlette/FastAPI in-process clients (disconnects need real servers:
see tests/servers/). TestClient and httpx.ASGITransport cannot make a client leave."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import anyio
import anyio.lowlevel
import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from asgi_cancel import CancelOnDisconnectMiddleware, current_token

PAYLOAD = b"x" * 200_000  # larger than the default read-ahead
# Starlette's BaseHTTPMiddleware leaves `Request.stream` unexhausted on trio, and trio's
# finalizer warns about it on Python 3.10 (seen with and without asgi-cancel): not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"size": len(body), "token_cancelled": current_token().cancelled})


async def stream(request: Request) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        for index in range(5):
            await anyio.lowlevel.checkpoint()
            yield b"%d" % index

    return StreamingResponse(chunks())


class Passthrough(BaseHTTPMiddleware):
    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers["x-inner"] = "1"
        return response


def starlette_app() -> Starlette:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])
    app.add_middleware(Passthrough)
    app.add_middleware(CancelOnDisconnectMiddleware)  # outermost user middleware
    return app


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_starlette_testclient_body_and_stream(backend: Literal["asyncio", "trio"]) -> None:
    with TestClient(starlette_app(), backend=backend) as client:
        response = client.post("/echo", content=PAYLOAD)
        assert response.json() == {"size": len(PAYLOAD), "token_cancelled": False}
        assert response.headers["x-inner"] == "1"
        streamed = client.get("/stream")
        assert streamed.text == "01234"


def test_fastapi_sync_endpoint_and_background_task() -> None:
    app = FastAPI()
    ran: list[bool] = []

    @app.post("/items")
    def create(item: dict[str, int], background: BackgroundTasks) -> dict[str, object]:
        background.add_task(lambda: ran.append(current_token().cancelled))
        return {"item": item, "cancelled": current_token().cancelled}

    app.add_middleware(CancelOnDisconnectMiddleware)
    with TestClient(app) as client:
        response = client.post("/items", json={"a": 1})
    assert response.json() == {"item": {"a": 1}, "cancelled": False}
    assert ran == [False]


@pytest.mark.anyio
async def test_httpx_asgi_transport_pass_through() -> None:
    app = CancelOnDisconnectMiddleware(starlette_app())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
        response = await client.post("/echo", content=PAYLOAD)
    assert response.json()["size"] == len(PAYLOAD)
