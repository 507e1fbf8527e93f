"""asgi_cancel.testing.ASGITransport against real frameworks' apps: the client leaves and the
app's own cleanup (a FastAPI dependency's teardown, a generator's `finally`) has run when the
client's call returns. Each has its control: httpx's ASGITransport, under which the app never
learns that its client left."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI
from quart import Quart
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.testing import AppStillRunning, ASGITransport
from asgi_cancel.types import AnyASGIApp

from .test_testing_transport import IDS, TRANSPORTS, client

pytestmark = [
    pytest.mark.anyio,
    # trio's finalizer warns about httpx's async generators left by a `break`: not ours.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]
CHUNKS = 200  # what a stream makes if nobody stops it
T = TypeVar("T")


async def read_one_chunk_and_leave(app: AnyASGIApp, transport: type, path: str = "/") -> None:
    with anyio.fail_after(10):
        async with client(transport(app)) as http, http.stream("GET", path) as response:
            async for _ in response.aiter_raw():
                break


async def sent_slowly(events: list[str], item: T) -> AsyncIterator[T]:
    """`item` `CHUNKS` times, one a millisecond; records "all sent" once they all were, and
    "generator ended" however it ends."""
    try:
        for _ in range(CHUNKS):
            yield item
            await anyio.sleep(0.001)
        events.append("all sent")
    finally:
        events.append("generator ended")


def fastapi_app(events: list[str], delay: float = 30) -> FastAPI:
    """`/`: a slow endpoint, `/stream`: a stream, each with a yield dependency."""
    api = FastAPI()

    async def session() -> AsyncIterator[str]:
        try:
            yield "session"
        finally:
            events.append("teardown")

    @api.get("/")
    async def slow(db: str = Depends(session)) -> dict[str, str]:
        try:
            await anyio.sleep(delay)
        except anyio.get_cancelled_exc_class():
            events.append("endpoint cancelled")
            raise
        events.append("endpoint done")
        return {"db": db}

    @api.get("/stream", dependencies=[Depends(session)])
    async def stream() -> StreamingResponse:
        return StreamingResponse(sent_slowly(events, b"token "))

    return api


@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_fastapi_yield_dependency_teardown_runs_when_the_client_times_out(
    transport: type,
) -> None:
    events: list[str] = []
    ours = transport is ASGITransport
    app = CancelOnDisconnectMiddleware(fastapi_app(events, delay=30 if ours else 0.3))
    with anyio.fail_after(10):
        async with client(transport(app), timeout=0.1) as http:
            if ours:
                with pytest.raises(httpx.ReadTimeout):
                    await http.get("/")
            else:  # no timeout: the control ignores it
                assert (await http.get("/")).json() == {"db": "session"}
            ended = "endpoint cancelled" if ours else "endpoint done"
            assert events == [ended, "teardown"]


@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_fastapi_stream_with_a_yield_dependency_stops_when_the_client_leaves(
    transport: type,
) -> None:
    events: list[str] = []
    await read_one_chunk_and_leave(fastapi_app(events), transport, "/stream")
    # The teardown's place differs between FastAPI versions (before the body before 0.118).
    assert "teardown" in events
    if transport is ASGITransport:
        assert "all sent" not in events
        assert "generator ended" in events
    else:
        assert "all sent" in events


def starlette_app(response: Callable[[], Response]) -> Starlette:
    """Starlette answering `/` with `response()`."""

    async def stream(request: Request) -> Response:
        return response()

    return Starlette(routes=[Route("/", stream)])


@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_starlette_streaming_response_stops_when_the_client_leaves(transport: type) -> None:
    events: list[str] = []
    app = starlette_app(lambda: StreamingResponse(sent_slowly(events, b"x,")))
    await read_one_chunk_and_leave(app, transport)
    if transport is ASGITransport:
        assert "all sent" not in events  # Starlette's own listener saw the disconnect
    else:
        assert "all sent" in events


@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_sse_starlette_stops_when_the_client_leaves(transport: type) -> None:
    # sse-starlette before 2.2 keeps one exit event for the process, bound to the first loop.
    if getattr(AppStatus, "should_exit_event", None) is not None:
        setattr(AppStatus, "should_exit_event", None)  # noqa: B010 (absent from new versions)
    events: list[str] = []
    app = starlette_app(lambda: EventSourceResponse(sent_slowly(events, {"data": "tick"})))
    await read_one_chunk_and_leave(app, transport)
    if transport is ASGITransport:
        assert events == ["generator ended"]
    else:
        assert events == ["all sent", "generator ended"]


def quart_app(events: list[str], delay: float) -> Quart:
    app = Quart(__name__)

    @app.route("/")
    async def slow() -> str:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            events.append("handler cancelled")  # Quart cancels it on http.disconnect
            raise
        events.append("handler done")
        return "done"

    return app


@pytest.mark.asyncio_only(reason="Quart runs on asyncio only")
@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_quart_cancels_its_handler_when_the_client_times_out(transport: type) -> None:
    events: list[str] = []
    ours = transport is ASGITransport
    with anyio.fail_after(10):
        app = quart_app(events, delay=30 if ours else 0.3)
        async with client(transport(app), timeout=0.1) as http:
            if ours:
                with pytest.raises(httpx.ReadTimeout):
                    await http.get("/")
            else:  # the control runs to its end
                assert (await http.get("/")).text == "done"
            assert events == (["handler cancelled"] if ours else ["handler done"])


async def test_fastapi_alone_runs_on_after_the_client_left_and_is_reported() -> None:
    events: list[str] = []
    transport = ASGITransport(fastapi_app(events, delay=30), exit_timeout=0.2)
    with anyio.fail_after(10):
        async with client(transport, timeout=0.1) as http:
            with pytest.raises(AppStillRunning, match=r"0\.2s after its client left"):
                await http.get("/")
            # FastAPI never listens for the disconnect: the transport cancelled it, and said so.
            assert events == ["endpoint cancelled", "teardown"]
