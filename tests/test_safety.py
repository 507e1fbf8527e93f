"""Safe cancellation for the code people write (DESIGN.md lines 10-13), at the ASGI level.

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
from asgi_cancel.types import Receive, Scope, Send

from .helpers import WATCHDOG, read_body, until, with_watchdog

pytestmark = pytest.mark.anyio

THREAD_WORK = 0.3
needs_cancelling = pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Python 3.10 has no Task.cancelling(): a framework's own cancellation is invisible",
)


# -- worker threads -----------------------------------------------------------------------------
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


@pytest.mark.parametrize("runner", list(THREAD_RUNNERS.values()), ids=list(THREAD_RUNNERS))
async def test_request_does_not_unwind_around_a_running_thread(runner: ThreadRunner) -> None:
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
        events.append("thread returned")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await runner(work)
            events.append("after the thread")
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        finally:
            events.append("teardown")

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: "thread started" in events)
    conn.disconnect()
    await with_watchdog(task)
    assert fired_while_thread_ran.is_set()  # the token told the thread at once
    assert events == [
        "thread started",
        "thread returned",
        "after the thread",
        "cancelled",
        "teardown",
    ]


async def test_thread_that_checks_the_token_stops_at_its_next_check() -> None:
    events: list[str] = []

    def work() -> None:
        token = current_token()
        events.append("thread started")
        for _ in range(1000):
            token.raise_if_cancelled()
            time.sleep(0.005)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await run_in_threadpool(work)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app)))
    await until(lambda: "thread started" in events)
    started = time.monotonic()
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["thread started", "cancelled"]
    assert time.monotonic() - started < 1.0  # not the 5 s the loop would take


class Session:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.closed = False

    def query(self) -> None:
        if self.closed:
            self.events.append("used after close")

    def close(self) -> None:
        self.closed = True
        self.events.append("session closed")


@pytest.mark.parametrize("endpoint_kind", ["def", "async def"])
async def test_fastapi_yield_dependency_torn_down_after_the_thread(endpoint_kind: str) -> None:
    """The usual `get_db()` dependency: closed only once the endpoint's thread is done."""
    events: list[str] = []

    def get_db() -> Iterator[Session]:
        db = Session(events)
        try:
            yield db
        finally:
            db.close()

    def work(db: Session) -> None:
        events.append("endpoint started")
        deadline = time.monotonic() + THREAD_WORK
        while time.monotonic() < deadline:
            db.query()
            time.sleep(0.005)
        events.append("endpoint returned")

    api = FastAPI()
    if endpoint_kind == "def":

        @api.get("/")
        def sync_endpoint(db: Session = Depends(get_db)) -> dict[str, str]:  # noqa: B008
            work(db)
            return {"status": "done"}

    else:

        @api.get("/")
        async def async_endpoint(db: Session = Depends(get_db)) -> dict[str, str]:  # noqa: B008
            await run_in_threadpool(work, db)
            await asyncio.sleep(30)
            return {"status": "done"}

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(api), http_scope("GET")))
    await until(lambda: "endpoint started" in events)
    conn.disconnect()
    await with_watchdog(task)
    assert events == ["endpoint started", "endpoint returned", "session closed"]


# -- apps that cancel their own work ------------------------------------------------------------
CLEANUP = 0.3


def self_cancelling_app(events: list[str], shape: str) -> Callable[..., Awaitable[None]]:
    """Django's shape (cancel the handler task, await it) or Quart's (cancel, gather)."""

    async def handler() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("handler cancelled")
            await asyncio.sleep(CLEANUP)  # cleanup that awaits, longer than `grace`
            events.append("cleanup done")
            raise

    async def listen(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        handler_task = asyncio.create_task(handler())
        listener = asyncio.create_task(listen(receive))
        await asyncio.wait([handler_task, listener], return_when=asyncio.FIRST_COMPLETED)
        handler_task.cancel()
        if shape == "django":
            try:
                await handler_task
            except asyncio.CancelledError:
                pass
        else:
            await asyncio.gather(handler_task, listener, return_exceptions=True)
        events.append("app finished")

    return app


@needs_cancelling
@pytest.mark.parametrize("shape", ["django", "quart"])
async def test_app_cancelling_its_own_handler_gets_no_second_cancellation(shape: str) -> None:
    events: list[str] = []
    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(self_cancelling_app(events, shape), grace=0.02)
    task = asyncio.create_task(conn.run(middleware))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    # The 0.3 s cleanup outlived the 0.02 s grace and completed; the middleware returned
    # only after the app had finished.
    assert events == ["handler cancelled", "cleanup done", "app finished"]


@needs_cancelling
async def test_task_group_listener_with_shielded_cleanup_is_left_to_finish() -> None:
    """Starlette's StreamingResponse below spec 2.4, sse-starlette: an anyio task group."""
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

    conn = ClientConnection()
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app, grace=0.02)))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
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
    scope = http_scope("GET")
    scope["asgi"] = {"version": "3.0", "spec_version": "2.3"}
    task = asyncio.create_task(conn.run(CancelOnDisconnectMiddleware(app), scope))
    await with_watchdog(conn.wait_for_body_chunks(3))
    conn.disconnect()
    await with_watchdog(task)
    assert conn.app_exception is None
    count = len(produced)
    await asyncio.sleep(0.1)
    assert len(produced) == count < 1000  # the iteration stopped with the request


# -- outside cancellations ----------------------------------------------------------------------
def sleeping_app(events: list[str]) -> Callable[..., Awaitable[None]]:
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
            events.append("app ended")

    return app


@pytest.mark.parametrize("disconnect", [False, True], ids=["connected", "disconnected"])
async def test_level_triggered_outside_cancel_scope_ends_the_request(disconnect: bool) -> None:
    """anyio cancels on every loop iteration until the scope is left: no livelock."""
    events: list[str] = []
    conn = ClientConnection()
    before = asyncio.all_tasks()
    with anyio.fail_after(WATCHDOG):  # the watchdog: a livelock would spin here forever
        with anyio.CancelScope() as scope:

            async def cancel_soon() -> None:
                await with_watchdog(conn.wait_for_body_chunks(1))
                if disconnect:
                    conn.disconnect()  # both in the same loop iteration
                scope.cancel()

            helper = asyncio.create_task(cancel_soon())
            await conn.run(CancelOnDisconnectMiddleware(sleeping_app(events)))
        await helper
    # Connected, the outside cancellation propagated out of the middleware; disconnected, the
    # middleware's own cancellation may win the race and return normally: both are fine.
    assert scope.cancelled_caught or disconnect
    assert events == ["app ended"]
    assert asyncio.all_tasks() - before == set()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout() is Python 3.11+")
async def test_asyncio_timeout_around_the_app_is_raised_promptly() -> None:
    events: list[str] = []
    conn = ClientConnection()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):  # type: ignore[attr-defined,unused-ignore]
            await conn.run(CancelOnDisconnectMiddleware(sleeping_app(events)))
    assert time.monotonic() - started < 1.0
    assert events == ["app ended"]


@needs_cancelling
def test_testclient_closing_an_unfinished_stream_cancels_the_app() -> None:
    """The issue's eleven lines: Starlette's TestClient closing a stream early."""
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(sleeping_app(events))
    with TestClient(app).stream("GET", "/") as response:
        assert next(response.iter_raw()) == b"hello"
    assert events == ["app ended"]


@needs_cancelling
def test_testclient_closing_the_client_cancels_an_unclosed_response() -> None:
    """Starlette's own test_closing_client_cancels_unclosed_response, with the app wrapped."""
    events: list[str] = []
    app = CancelOnDisconnectMiddleware(sleeping_app(events))
    with TestClient(app) as client:
        stream = client.stream("GET", "/")
        response = stream.__enter__()  # never exited: the client's close ends it
        assert next(response.iter_raw()) == b"hello"
    assert events == ["app ended"]


# -- outer middlewares --------------------------------------------------------------------------
async def test_outer_base_http_middleware_gets_a_response_not_an_error() -> None:
    """asgi-cancel inside `@app.middleware("http")`: no "No response returned." error."""
    events: list[str] = []
    statuses: list[int] = []

    async def slow(request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return Response("done")

    async def dispatch(request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        statuses.append(response.status_code)
        return response

    inner = CancelOnDisconnectMiddleware(Starlette(routes=[Route("/", slow)]))
    app = BaseHTTPMiddleware(inner, dispatch=dispatch)
    conn = ClientConnection()
    task = asyncio.create_task(conn.run(app, http_scope("GET")))
    await until(lambda: conn.receive_calls >= 2)
    conn.disconnect()
    await with_watchdog(task)
    assert conn.app_exception is None
    assert events == ["cancelled"]
    assert statuses == [499]


async def test_normal_request_is_unchanged_behind_an_outer_middleware() -> None:
    async def hello(request: Request) -> Response:
        return Response("hello", headers={"x-app": "1"})

    async def dispatch(request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)

    inner = Starlette(routes=[Route("/", hello)])
    results = []
    for app in (inner, CancelOnDisconnectMiddleware(inner)):
        conn = ClientConnection()
        await with_watchdog(conn.run(BaseHTTPMiddleware(app, dispatch=dispatch), http_scope()))
        results.append(conn.sent)
    assert results[0] == results[1]
    assert results[0][0]["status"] == 200
