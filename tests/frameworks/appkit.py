"""What the framework apps share (they run inside the server process).

Their events (`servers.events.record`, keyed by `?id=`): `start`; `cancelled` (a
`CancelledError`, in the handler, its stream or its thread's `raise_if_cancelled()`), `stopped`
(a thread, or another loop, saw the token) or `closed_by_framework` (a stream's generator);
`cleanup_done` (an `except CancelledError` cleanup's awaited work); `finally`; `teardown` (a
dependency's "database session" closed) and `used_after_close` (never allowed);
`thread_returned`; `done` (the work ran to its end); `bg_done` (a background task); `hook` (the
middleware's `on_cancelled`) and `exit` (how the whole ASGI app ended). Websocket endpoints:
`ticking` (busy: sends without reading) and `echoing` (listening: `disconnected` with the code
its framework raised).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

from asgi_cancel import CancelOnDisconnectMiddleware, current_token

from ..servers.events import (
    ASGIApp,
    log_cancellations_to_stderr,
    record,
    record_hook,
    recording_exit,
    token_state,
)

CHUNK = b"chunk\n"
CHUNK_INTERVAL = 0.02
STEP = 0.01  # one unit of blocking work in a worker thread
ROLLBACK = 0.05  # what a thread still does with its resource once it saw the token
BACKGROUND_WORK = 0.3
NORMAL_BODY = "normal body: 0123456789"
NORMAL_HEADER = ("x-matrix", "normal")


def is_cancelled() -> bool | None:
    """The request's token has fired (None in the control apps: no middleware, no token)."""
    return cast("bool | None", token_state()["token_cancelled"])


def record_stop(rid: str, exc: BaseException | None) -> None:
    """`cancelled` (by `exc`) or, for None, `stopped`: work that saw the token and stopped."""
    kind = "stopped" if exc is None else "cancelled"
    record(rid, kind, exc="none" if exc is None else type(exc).__name__, **token_state())


def served(app: Any, *, wrap: bool = False) -> ASGIApp:
    """A framework's app as the server gets it, recording how each request ended; `wrap`: in
    the middleware, as `app = CancelOnDisconnectMiddleware(app)` (where there is no
    `app.add_middleware`)."""
    asgi = cast("ASGIApp", app)
    if wrap:
        asgi = CancelOnDisconnectMiddleware(asgi, on_cancelled=record_hook)
    log_cancellations_to_stderr()
    return recording_exit(asgi)


async def slow_work(
    rid: str, seconds: float, cleanup: float = 0.0, resource: Resource | None = None
) -> None:
    """Work `seconds` in steps, using `resource` at each; on cancellation use it once more (a
    rollback) and await `cleanup` seconds of cleanup, then re-raise."""
    record(rid, "start")
    try:
        for _ in range(int(seconds / STEP)):
            await asyncio.sleep(STEP)
            if resource is not None:
                resource.use("step")
    except asyncio.CancelledError as exc:
        record_stop(rid, exc)
        if resource is not None:
            resource.use("rollback")  # the session is still open while the endpoint unwinds
        if cleanup:
            await asyncio.sleep(cleanup)  # e.g. `await engine.abort(request_id)`
            record(rid, "cleanup_done", seconds=cleanup)
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


async def chunks(
    rid: str, seconds: float, wrap: Callable[[bytes], Any] = bytes
) -> AsyncIterator[Any]:
    """A stream of `wrap(CHUNK)` for `seconds` (`wrap`: a framework's event type)."""
    record(rid, "start")
    try:
        for _ in range(int(seconds / CHUNK_INTERVAL)):
            yield wrap(CHUNK)
            await asyncio.sleep(CHUNK_INTERVAL)
    except asyncio.CancelledError as exc:
        record_stop(rid, exc)
        raise
    except GeneratorExit:  # closed by the framework without a cancellation
        record(rid, "closed_by_framework", **token_state())
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


class Resource:
    """A stand-in for a database session: it must not be used once it is closed."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.closed = False

    def use(self, what: str) -> None:
        if self.closed:
            record(self.rid, "used_after_close", what=what)

    def close(self) -> None:
        record(self.rid, "teardown", already_closed=self.closed)
        self.closed = True


def resource_dependency(rid: str) -> Iterator[Resource]:
    """`def get_db(): db = Session(); try: yield db; finally: db.close()`."""
    resource = Resource(rid)
    try:
        yield resource
    finally:
        resource.close()


def blocking_work(
    rid: str, seconds: float, resource: Resource | None = None, check: str = "flag"
) -> str:
    """Sync work in a worker thread: steps of blocking work, checking the token between them,
    by `token.cancelled` (`check="flag"`) or `token.raise_if_cancelled()` (`"raise"`).

    Once it sees the flag, it still uses its resource for a moment (a rollback), as real code
    does: that use must not come after the resource's teardown.
    """
    record(rid, "start")  # the thread copied the request's context: the token is there
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(STEP)
            if resource is not None:
                resource.use("step")
            if is_cancelled():
                if check == "raise":
                    current_token().raise_if_cancelled()
                record_stop(rid, None)
                time.sleep(ROLLBACK)
                if resource is not None:
                    resource.use("rollback")
                return "stopped"
        record(rid, "done")
        return "sync done"
    except asyncio.CancelledError as exc:
        record_stop(rid, exc)
        raise
    finally:
        record(rid, "thread_returned")


async def polling_async_work(rid: str, seconds: float) -> str:
    """Async work that cannot be cancelled from the request's task (it runs on another loop,
    under `async_to_sync`): it stops by polling the token."""
    record(rid, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(STEP)
        if is_cancelled():
            record_stop(rid, None)
            return "stopped"
    record(rid, "done")
    return "async done"


async def background_work(rid: str) -> None:
    await asyncio.sleep(BACKGROUND_WORK)
    record(rid, "bg_done", **token_state())


async def ticking(rid: str, seconds: float, send_text: Callable[[str], Awaitable[None]]) -> None:
    """A websocket endpoint busy sending (an LLM streaming tokens): `tick <i>` every
    CHUNK_INTERVAL for `seconds`, never reading what the client sends."""
    record(rid, "start", **token_state())
    try:
        for index in range(int(seconds / CHUNK_INTERVAL)):
            await send_text(f"tick {index}")
            await asyncio.sleep(CHUNK_INTERVAL)
    except asyncio.CancelledError as exc:
        record_stop(rid, exc)
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


async def echoing(
    rid: str,
    receive_text: Callable[[], Awaitable[str]],
    send_text: Callable[[str], Awaitable[None]],
    disconnected: tuple[type[Exception], ...] = (),
) -> None:
    """A listening websocket endpoint: echoes each message until its framework raises one of
    `disconnected` (recorded with its `code`), or cancels it."""
    record(rid, "start", **token_state())
    try:
        while True:
            await send_text(await receive_text())
    except disconnected as exc:
        record(rid, "disconnected", code=getattr(exc, "code", None), **token_state())
    except asyncio.CancelledError as exc:  # Quart cancels a handler whose client left
        record_stop(rid, exc)
        raise
    finally:
        record(rid, "finally")
