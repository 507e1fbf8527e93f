"""Safe cancellation for the code people write (docs/contract.md lines 10-13), at the ASGI level.

Worker threads (the request never unwinds around a running thread), apps and frameworks that
cancel their own work (no second cancellation during their cleanup), outside cancellations of
every kind (prompt, no spinning, re-raised), and outer middlewares that wait for a response.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import anyio
import pytest
from asgiref.sync import sync_to_async
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from asgi_cancel import CancelOnDisconnectMiddleware, current_token
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .helpers import (
    WATCHDOG,
    leave,
    noting_cancellation,
    read_body,
    run_quietly,
    tasks_alive,
    with_watchdog,
    xfail_on,
)

pytestmark = pytest.mark.anyio

THREAD_WORK = 0.3
CLEANUP = 0.3
# Known issues in asgi_cancel, pinned by strict xfails.
REACTION_UNSEEN_ON_TRIO = (
    "gap (trio): an app that reacted to the disconnect itself is still cancelled `grace` "
    "after it: a shielded cleanup completes, the code after it is cut"
)
needs_cancelling = pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Python 3.10 has no Task.cancelling(): a framework's own cancellation is invisible",
)


# -- 11. worker threads -------------------------------------------------------------------------
ThreadRunner = Callable[[Callable[[], None]], Awaitable[object]]


async def _run_in_executor(work: Callable[[], None]) -> object:
    # Litestar's sync_to_thread: run_in_executor does not copy the context by itself.
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(None, context.run, work)


THREAD_RUNNERS: dict[str, ThreadRunner] = {
    "anyio.to_thread": anyio.to_thread.run_sync,
    "starlette.run_in_threadpool": run_in_threadpool,
    "asyncio.to_thread": asyncio.to_thread,
    "loop.run_in_executor": _run_in_executor,
    "asgiref.sync_to_async": lambda work: sync_to_async(work, thread_sensitive=False)(),
}
ANYIO_RUNNERS = ("anyio.to_thread", "starlette.run_in_threadpool")  # the others are asyncio's
ON_EACH_RUNNER = pytest.mark.parametrize(
    ("anyio_backend", "runner"),
    [("asyncio", name) for name in THREAD_RUNNERS] + [("trio", name) for name in ANYIO_RUNNERS],
    ids=lambda value: str(value),
)


@ON_EACH_RUNNER
async def test_request_does_not_unwind_around_a_running_thread(
    anyio_backend: str, runner: str
) -> None:
    """The token fires at once; the cancellation lands at the next await after the thread."""
    events: list[str] = []
    fired_while_thread_ran = threading.Event()

    def work() -> None:
        token = current_token()
        events.append("thread started")
        deadline = time.monotonic() + THREAD_WORK
        while time.monotonic() < deadline:  # does not check the token: runs to its end
            if token.cancelled:
                fired_while_thread_ran.set()
            time.sleep(0.005)
        events.append("thread done")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await THREAD_RUNNERS[runner](work)
            events.append("after the thread")
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise
        finally:
            events.append("teardown")

    await leave(CancelOnDisconnectMiddleware(app), when=lambda: "thread started" in events)
    assert fired_while_thread_ran.is_set()  # the token told the thread at once
    assert events == ["thread started", "thread done", "after the thread", "cancelled", "teardown"]


@ON_EACH_RUNNER
async def test_a_loop_of_thread_calls_and_sends_stops_after_the_running_thread(
    anyio_backend: str, runner: str
) -> None:
    """A generation stepped in a worker thread, each chunk sent: the cancellation lands at the
    send after the running thread (asyncio's thread calls await nothing else in between)."""
    stepped: list[int] = []

    def step() -> None:
        time.sleep(0.02)
        stepped.append(len(stepped))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(100):
            await THREAD_RUNNERS[runner](step)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})

    conn = await leave(CancelOnDisconnectMiddleware(app), when=lambda: len(stepped) == 3)
    assert conn.app_exception is None
    assert len(stepped) <= 5, stepped  # without the checkpoint: all 100


@pytest.mark.parametrize("endpoint_kind", ["def", "async-def"])
async def test_fastapi_yield_dependency_torn_down_after_the_thread(endpoint_kind: str) -> None:
    """The usual `get_db()` dependency: closed only once the endpoint's thread is done."""
    events: list[str] = []

    def get_db() -> Iterator[str]:
        try:
            yield "session"
        finally:
            events.append("session closed")

    def work(db: str) -> None:
        events.append("endpoint started")
        time.sleep(THREAD_WORK)  # uses the session all along
        events.append("endpoint returned")

    api = FastAPI()

    @api.get("/def")
    def sync_endpoint(db: str = Depends(get_db)) -> dict[str, str]:
        work(db)
        return {"status": "done"}

    @api.get("/async-def")
    async def async_endpoint(db: str = Depends(get_db)) -> dict[str, str]:
        await run_in_threadpool(work, db)
        await anyio.sleep(30)
        return {"status": "done"}

    middleware = CancelOnDisconnectMiddleware(api)
    scope = http_scope(path=f"/{endpoint_kind}")
    await leave(middleware, scope=scope, when=lambda: "endpoint started" in events)
    assert events == ["endpoint started", "endpoint returned", "session closed"]


# -- 10. apps that cancel their own work (Django's and Quart's shapes: test_asyncio.py) ---------
@needs_cancelling
async def test_task_group_listener_with_shielded_cleanup_is_left_to_finish(
    request: pytest.FixtureRequest,
) -> None:
    """Starlette's StreamingResponse below spec 2.4, sse-starlette: an anyio task group."""
    xfail_on("trio", request, reason=REACTION_UNSEEN_ON_TRIO)
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)

        async def stream() -> None:
            try:
                await anyio.sleep(30)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(CLEANUP)
                    events.append("cleanup done")

        async with anyio.create_task_group() as group:

            async def listen() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(listen)
            group.start_soon(stream)
        events.append("app finished")

    await leave(CancelOnDisconnectMiddleware(app, grace=0.02))
    assert events == ["cleanup done", "app finished"]


async def test_streaming_response_below_spec_2_4_with_sync_iterator() -> None:
    """Starlette iterates a sync generator in the threadpool and listens itself."""
    produced: list[int] = []

    def chunks() -> Iterator[bytes]:
        for index in range(1000):
            time.sleep(0.005)
            produced.append(index)
            yield b"%d\n" % index

    async def endpoint(request: Request) -> Response:
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/", endpoint)])
    conn = ClientConnection()
    scope = http_scope("GET", spec_version="2.3")
    await leave(CancelOnDisconnectMiddleware(app), conn, scope, when=lambda: conn.body_chunks >= 3)
    assert conn.app_exception is None
    count = len(produced)
    await anyio.sleep(0.1)
    assert len(produced) == count < 1000  # the iteration stopped with the request


# -- 12. outside cancellations ------------------------------------------------------------------
def sleeping_app(events: list[str], cleanup: str = "") -> ASGIApp:
    """Starts a stream, then sleeps until cancelled; with a `cleanup` ("reraises", "raises-error"),
    one that awaits (shielded), then re-raises the cancellation or raises an error of its own."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        try:
            await anyio.sleep_forever()
        finally:
            if cleanup:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.01)
            events.append("app ended")
            if cleanup == "raises-error":
                raise RuntimeError("cleanup failed") from None

    return app


@pytest.mark.parametrize(
    ("disconnect", "cleanup"),
    [(False, "reraises"), (True, "reraises"), (False, "raises-error")],
    ids=["connected", "disconnected", "cleanup-raises"],
)
async def test_level_triggered_outside_cancellation_is_reraised_or_the_apps_own_error(
    disconnect: bool, cleanup: str
) -> None:
    """Server shutdown as an outer anyio scope, which cancels on every loop iteration until it
    is left: no livelock, nothing left behind, and what the app raised reaches the server."""
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(sleeping_app(events, cleanup))
    conn = ClientConnection()
    before = tasks_alive()
    with anyio.fail_after(WATCHDOG), anyio.CancelScope() as outside:  # a livelock would spin
        async with anyio.create_task_group() as group:
            group.start_soon(run_quietly, conn, app)
            await conn.wait_for_body_chunks(1)
            if disconnect:
                conn.disconnect()  # both in the same loop iteration
            outside.cancel()
    assert events == ["app ended"]
    assert tasks_alive() == before
    with pytest.raises(RuntimeError):
        current_token()  # nothing of the request is left in the context
    if cleanup == "raises-error":
        assert isinstance(conn.app_exception, RuntimeError)
    else:  # disconnected, the middleware's own cancellation may win the race: both are fine
        cancelled = isinstance(conn.app_exception, anyio.get_cancelled_exc_class())
        assert cancelled or (disconnect and conn.app_exception is None)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout() is Python 3.11+")
@pytest.mark.asyncio_only(reason="asyncio.timeout()")
async def test_asyncio_timeout_around_the_app_is_raised_promptly() -> None:
    events: list[str] = []
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):  # type: ignore[attr-defined,unused-ignore]
            await ClientConnection().run(CancelOnDisconnectMiddleware(sleeping_app(events)))
    assert time.monotonic() - started < 1.0
    assert events == ["app ended"]


@needs_cancelling
@pytest.mark.parametrize("close", ["stream", "client"])
def test_testclient_closing_an_unfinished_stream_cancels_the_app(close: str) -> None:
    """The issue's eleven lines (Starlette's TestClient closing a stream early), and
    Starlette's own test_closing_client_cancels_unclosed_response with the app wrapped."""
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(sleeping_app(events))
    with TestClient(app) as client:
        stream = client.stream("GET", "/")
        response = stream.__enter__()
        assert next(response.iter_raw()) == b"hello"
        if close == "stream":
            stream.__exit__(None, None, None)
            assert events == ["app ended"]
    assert events == ["app ended"]  # "client": never exited, the client's close ends it


# -- 13 and 17. outer middlewares --------------------------------------------------------------
# BaseHTTPMiddleware on trio, Python 3.10: the warning tests/test_frameworks.py explains.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_outer_base_http_middleware_gets_a_response_not_an_error() -> None:
    """asgi-cancel inside `@app.middleware("http")`: no "No response returned." error for a
    client that left, and, for one that stays, the response it would get without asgi-cancel."""
    events: list[str] = []
    statuses: list[int] = []

    async def slow(request: Request) -> Response:
        with noting_cancellation(events):
            await anyio.sleep(30)
        return Response("done")  # pragma: no cover

    async def hello(request: Request) -> Response:
        return Response("hello", headers={"x-app": "1"})

    async def dispatch(request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        statuses.append(response.status_code)
        return response

    inner = Starlette(routes=[Route("/", slow), Route("/hello", hello)])
    conn = await leave(BaseHTTPMiddleware(CancelOnDisconnectMiddleware(inner), dispatch=dispatch))
    assert conn.app_exception is None
    assert events == ["cancelled"]
    sent = []
    for app in (inner, CancelOnDisconnectMiddleware(inner)):
        conn = ClientConnection()
        outer = BaseHTTPMiddleware(app, dispatch=dispatch)
        await with_watchdog(conn.run(outer, http_scope(path="/hello")))
        sent.append(conn.sent)
    assert sent[0] == sent[1]
    assert statuses == [499, 200, 200]
