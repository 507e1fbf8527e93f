"""The asyncio driver (`_asyncio.py`): ONE `Task.cancel()` (docs/contract.md line 5), outside
cancellations (a server's shutdown: `Task.cancel()` on the request's task) meeting ours,
`Task.uncancel()`, the app's first step taken by hand, vLLM's `with_cancellation` shape (the
grace period's extra loop iterations), and a finished request freed by reference counting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    CancelToken,
    current_token,
    shield,
)
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

from .helpers import (
    REQUEST_DONE,
    WATCHDOG,
    QueueServer,
    leave,
    noting_cancellation,
    read_body,
    respond,
    until,
    watching,
    with_watchdog,
)

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only(reason="the asyncio driver's own")]

NO_CANCELLING_ON_3_10 = "Python 3.10 has no Task.cancelling()/uncancel(): "
NEEDS_CANCELLING = pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.uncancel(): 3.11+")


async def serve(app: ASGIApp, conn: ClientConnection) -> str:
    """A server's request task: how the middleware's call ended, and whether the task was
    left cancelling (a TaskGroup later in it would report CancelledError instead of its
    child's error: TaskGroup.__aexit__ checks `uncancel() == 0`)."""
    try:
        await CancelOnDisconnectMiddleware(app)(http_scope(), conn.receive, conn.send)
        outcome = "returned"
    except asyncio.CancelledError:
        return "CancelledError"
    except RuntimeError as exc:
        outcome = f"raised {exc}"
    await asyncio.sleep(0)  # the server carries on in the same task (hypercorn: send(None))
    task = asyncio.current_task()
    assert task is not None
    if sys.version_info >= (3, 11):
        return f"{outcome}, cancelling={task.cancelling()}"
    return f"{outcome}, cancelling=0"  # 3.10 cannot tell


async def watched(app: ASGIApp, conn: ClientConnection) -> asyncio.Task[str]:
    """`serve()` in a task of its own, once the client's connection is watched."""
    task = asyncio.create_task(serve(app, conn))
    await until(lambda: watching(conn))
    return task


async def serve_and_leave(app: ASGIApp, conn: ClientConnection | None = None) -> str:
    conn = conn if conn is not None else ClientConnection()
    task = await watched(app, conn)
    conn.disconnect()
    return await with_watchdog(task)


# -- 5. one Task.cancel() -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "then", ["reraises", "swallows", pytest.param("raises-an-error", marks=NEEDS_CANCELLING)]
)
async def test_the_cancellation_is_one_task_cancel(then: str) -> None:
    """Edge-triggered: `except CancelledError: await engine.abort()` and `finally:` run to
    completion; an app that swallows it finishes its work, never cancelled a second time; one
    that turns it into an error does not leave the server's task cancelling."""
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            for _ in range(3):
                await asyncio.sleep(0.005)  # an engine abort: must not be cancelled again
            events.append("abort done")
            if then == "raises-an-error":
                raise RuntimeError("client went away") from None
            if then == "reraises":
                raise
        finally:
            await asyncio.sleep(0.005)
            events.append("finally done")
        events.append("finished anyway")
        await respond(send)  # dropped

    conn = ClientConnection()
    outcome = "raised client went away" if then == "raises-an-error" else "returned"
    assert await serve_and_leave(app, conn) == f"{outcome}, cancelling=0"
    swallowed = ["finished anyway"] if then == "swallows" else []
    assert events == ["abort done", "finally done", *swallowed]
    assert conn.sent == []


async def test_shield_exit_then_dropped_response_does_not_leak_a_cancel_to_the_server() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        token = current_token()
        with shield():
            await until(lambda: token.cancelled)  # a commit that spans the disconnect
        await respond(send)  # the client is gone: both sends are dropped, neither suspends

    assert await serve_and_leave(app) == "returned, cancelling=0"


# -- outside cancellations: Task.cancel() on the request's task ---------------------------------
@pytest.mark.xfail(
    sys.version_info < (3, 11),
    strict=True,
    reason=NO_CANCELLING_ON_3_10 + "an outside cancellation that arrives while the app handles "
    "ours is absorbed (bug: tagging our cancel with a message would tell them apart), and one "
    "in progress cannot be seen, so the disconnect's cancel lands on top of its cleanup",
)
@pytest.mark.parametrize(
    ("first", "cleanup"),
    [("disconnect", "cleanup interrupted"), ("shutdown", "cleanup done")],
    ids=["shutdown-during-our-cancellation", "disconnect-during-a-shutdown"],
)
async def test_outside_and_own_cancellation_together(first: str, cleanup: str) -> None:
    """The server's cancellation propagates and may cut the cleanup; ours never cuts the
    cleanup of the server's."""
    events: list[str] = []
    cleanup_started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cleanup_started.set()
            try:
                await asyncio.sleep(0.05)  # await engine.abort(...)
            except asyncio.CancelledError:
                events.append("cleanup interrupted")
                raise
            events.append("cleanup done")
            raise

    conn = ClientConnection()
    task = await watched(app, conn)
    steps: list[Callable[[], object]] = [conn.disconnect, task.cancel]  # leave; shut down
    if first == "shutdown":
        steps.reverse()
    steps[0]()
    await with_watchdog(cleanup_started.wait())
    steps[1]()  # while the app cleans up
    assert await with_watchdog(task) == "CancelledError"
    assert events == [cleanup]


async def test_outside_cancel_during_finish_leaves_no_task_behind() -> None:
    events: list[str] = []
    release = asyncio.Event()

    async def abort() -> None:
        await release.wait()  # a slow engine abort

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        current_token().on_cancel(abort)
        await read_body(receive)
        with noting_cancellation(events):
            await asyncio.sleep(30)

    before = asyncio.all_tasks()
    conn = ClientConnection()
    task = await watched(app, conn)
    conn.disconnect()
    await until(lambda: events == ["cancelled"])
    await asyncio.sleep(0.01)  # __call__ now waits for abort() before it returns
    task.cancel()  # server shutdown
    try:
        assert await with_watchdog(task) == "CancelledError"
        assert asyncio.all_tasks() - before == set()
    finally:
        release.set()
        await asyncio.sleep(0.01)


# -- the watcher's end -------------------------------------------------------------------------
WATCHER_ENDS = {
    # uvicorn: the watcher's receive() is answered once the response is complete
    "answered at the response's end": (True, False, "finished"),
    # a server that answers it, then waits again in the same call: cancelled after its step
    "answered, then waits again": (True, True, "cancelled"),
    # hypercorn, daphne: still pending when the request ends
    "still pending": (False, False, "cancelled"),
}


@pytest.mark.parametrize(("answers", "again", "end"), WATCHER_ENDS.values(), ids=WATCHER_ENDS)
async def test_the_watcher_ends_by_itself_once_its_receive_is_answered(
    answers: bool, again: bool, end: str
) -> None:
    loop = asyncio.get_running_loop()
    complete = asyncio.Event()
    calls = 0
    ends: list[str] = []

    async def receive() -> Message:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        try:
            await (complete.wait() if answers else loop.create_future())
            if again:
                await loop.create_future()
        except asyncio.CancelledError:
            ends.append("cancelled")
            raise
        ends.append("finished")
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if not message.get("more_body", False) and message["type"] == "http.response.body":
            complete.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await until(lambda: calls == 2)  # watched, its receive pending
        await respond(send)

    before = asyncio.all_tasks()
    middleware = CancelOnDisconnectMiddleware(app, watch_delay=0)
    await with_watchdog(middleware(http_scope("GET"), receive, send))
    assert ends == [end]
    assert asyncio.all_tasks() - before == set()


# -- the first step taken by hand; freed by reference counting ----------------------------------
@pytest.mark.parametrize("waits", [False, True], ids=["never waits", "waits once"])
async def test_a_request_that_never_waits_leaves_the_loop_alone(
    waits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's first step is taken by hand: a request that ends in it schedules nothing on
    the loop (no task, no timer, no callback, no future). One that waits gets its watch timer
    (the control: a middleware that armed it up front, not knowing, fails the first case)."""
    loop = asyncio.get_running_loop()
    scheduled: list[str] = []

    def recording(name: str) -> Callable[..., Any]:
        method = getattr(loop, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            scheduled.append(name)
            return method(*args, **kwargs)

        return recorded

    for name in ("call_soon", "call_later", "call_at", "create_future", "create_task"):
        monkeypatch.setattr(loop, name, recording(name))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if waits:
            await asyncio.sleep(0)
        await respond(send)

    server = QueueServer({"type": "http.request", "body": b"hi", "more_body": False})
    middleware = CancelOnDisconnectMiddleware(app)
    await middleware(http_scope("POST"), server.receive, server.send)
    if waits:
        assert "call_later" in scheduled  # the watch timer (and asyncio.sleep's own call_soon)
    else:
        assert scheduled == []
    assert [m["type"] for m in server.sent] == ["http.response.start", "http.response.body"]


@pytest.mark.parametrize("path", ["/fast", "/cancelled", "/slow"])
async def test_finished_requests_cycle_is_freed_by_refcount(path: str) -> None:
    """No timer, watcher or callback keeps a finished request's cycle alive. (On trio the
    finished cycle waits for the garbage collector.)"""
    tokens: list[CancelToken] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        token = current_token()
        tokens.append(token)
        token.on_cancel(lambda: None)
        await read_body(receive)
        if path != "/fast":
            await asyncio.sleep(0.01 if path == "/slow" else 30)
        await respond(send)

    async def one_request() -> None:  # its locals are gone when it returns
        middleware = CancelOnDisconnectMiddleware(app)
        if path == "/cancelled":
            await leave(middleware, scope=http_scope(path=path))
        else:
            await with_watchdog(ClientConnection().run(middleware, http_scope(path=path)))

    await one_request()
    await asyncio.sleep(0.01)  # the timers have run
    gc.disable()
    try:
        # getrefcount: the list's reference and the argument's, nothing else (computed
        # outside the assert: pytest's rewriting would hold one more reference).
        count = sys.getrefcount(tokens[0])
        assert count == 2
    finally:
        gc.enable()


# -- 9/10. apps that cancel their own handler task -----------------------------------------------
def self_cancelling_app(
    outcome: dict[str, Any], shape: str, *, cleanup: float = 0.0, watcher_reads: bool = False
) -> ASGIApp:
    """The handler and a disconnect listener in tasks of their own, the first to end cancelling
    the other: Django 5 then awaits the handler, Quart gathers both, and vLLM's
    `with_cancellation` (vllm/entrypoints/utils.py) awaits nothing: its
    `asyncio.wait(FIRST_COMPLETED)` does not cancel the tasks it waits on when the wrapper itself
    is cancelled, so the middleware must not cancel the wrapper before it has cancelled them."""

    async def handler() -> None:
        try:
            await asyncio.sleep(30)  # the engine generates
        except asyncio.CancelledError:
            outcome["handler"] = "cancelled"
            await asyncio.sleep(cleanup)  # cleanup that awaits, maybe longer than `grace`
            outcome["cleanup"] = "done"
            raise

    async def listen(receive: Receive) -> None:
        outcome["listening"] = True
        while (await receive())["type"] != "http.disconnect":
            pass

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if watcher_reads:
            # Some await between the body and the handler (a dependency, validation): the
            # middleware's watcher holds the server's receive before the listener asks.
            await asyncio.sleep(0.02)
        handler_task = outcome["handler_task"] = asyncio.create_task(handler())
        listener = asyncio.create_task(listen(receive))
        try:
            done, pending = await asyncio.wait(
                [handler_task, listener], return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            outcome["app"] = "cancelled while waiting"
            raise
        for task in pending:
            task.cancel()
        if shape == "django":
            with contextlib.suppress(asyncio.CancelledError):
                await handler_task
        elif shape == "quart":
            await asyncio.gather(handler_task, listener, return_exceptions=True)
        outcome["app"] = "handler done" if handler_task in done else "disconnect won"
        await respond(send, b"null")  # FastAPI would serialise vLLM's None: dropped

    return app


@NEEDS_CANCELLING
@pytest.mark.parametrize("shape", ["django", "quart"])
async def test_app_cancelling_its_own_handler_gets_no_second_cancellation(shape: str) -> None:
    outcome: dict[str, Any] = {}
    app = self_cancelling_app(outcome, shape, cleanup=0.3)
    conn = await leave(CancelOnDisconnectMiddleware(app, grace=0.02))
    # The 0.3 s cleanup outlived the 0.02 s grace and completed; the middleware returned
    # only after the app had finished.
    assert outcome["handler_task"].done()
    ended = (outcome["handler"], outcome["cleanup"], outcome["app"])
    assert ended == ("cancelled", "done", "disconnect won")
    assert conn.app_exception is None


@pytest.mark.parametrize("stop", ["disconnect", "disconnect-in-a-busy-loop", "cancel-by-id"])
@pytest.mark.parametrize("watcher_reads", [False, True], ids=["listener-reads", "watcher-reads"])
async def test_with_cancellation_gets_the_disconnect_first_and_nothing_is_orphaned(
    stop: str, watcher_reads: bool
) -> None:
    """The listener gets http.disconnect first, so the wrapper cancels its handler task before
    the middleware would cancel the wrapper. Also when the loop is busier than `grace` as the
    client leaves (another request, a large batch of engine outputs, a GC pause): the wrapper
    still gets the loop iterations it needs. And on a cancel by id while the client stays: the
    listener, even one that asked the server's receive itself before the watcher started, gets
    http.disconnect, and the client the 499."""
    outcome: dict[str, Any] = {}
    registry = CancelRegistry()
    conn = ClientConnection(b"{}")
    app = self_cancelling_app(outcome, "vllm", watcher_reads=watcher_reads)
    by_id = stop == "cancel-by-id"
    middleware = CancelOnDisconnectMiddleware(app, registry=registry, grace=1 if by_id else 0.1)
    scope = http_scope("POST", headers=[(b"x-request-id", b"r1")])
    task = asyncio.create_task(conn.run(middleware, scope))
    if by_id:
        await until(lambda: "listening" in outcome and watching(conn))
        assert registry.cancel("r1")
    else:
        await until(lambda: "handler_task" in outcome)
        conn.disconnect()
        if stop == "disconnect-in-a-busy-loop":  # ready in the same loop iteration
            asyncio.get_running_loop().call_soon(time.sleep, 0.3)
    await with_watchdog(task)
    await asyncio.sleep(0.05)
    handler_task = outcome["handler_task"]
    orphaned = not handler_task.done()
    handler_task.cancel()
    assert not orphaned, outcome
    assert (outcome["app"], outcome["handler"]) == ("disconnect won", "cancelled")
    assert conn.app_exception is None
    if by_id:
        assert conn.status == 499
    else:
        assert conn.sent == []  # the client is gone: nothing reached it


@pytest.mark.parametrize("scope_type", ["http", "websocket"])
async def test_an_anyio_scope_cancelled_as_the_app_ends_still_knows_its_cancellation(
    scope_type: str,
) -> None:
    """The scope around the middleware is cancelled while the middleware waits for its
    watcher task (a test client tearing down, an outer timeout): it re-raises that very
    cancellation, which anyio recognises by its message and stops at its scope, instead of a
    new one that would escape it."""
    websocket = scope_type == "websocket"
    server = QueueServer({"type": "websocket.connect"} if websocket else REQUEST_DONE)
    cancelled: list[anyio.CancelScope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await asyncio.sleep(0.02)  # past watch_delay: an HTTP request gets its watcher too
        if websocket:
            await send({"type": "websocket.close", "code": 1000})
        else:
            await respond(send)
        asyncio.get_running_loop().call_soon(cancelled[0].cancel)  # as the app ends

    scope = {"type": "websocket", "path": "/"} if websocket else http_scope()
    with anyio.fail_after(WATCHDOG):
        with anyio.CancelScope() as outer:
            cancelled.append(outer)
            await CancelOnDisconnectMiddleware(app)(scope, server.receive, server.send)
            await anyio.sleep_forever()
    assert outer.cancelled_caught
