"""App-side helpers shared by the framework apps (they run inside the server process).

Every app records its events with `servers.events.record`, keyed by the request's `?id=`. The
vocabulary is the same for every framework:

- `start`: the handler began its work;
- `cancelled`: the handler (or its stream) caught `CancelledError`;
- `stopped`: code in a worker thread (or another event loop) saw `token.cancelled` and stopped;
- `cleanup_done`: an `except CancelledError` cleanup finished its awaited work;
- `finally`: the handler's `finally` block ran (counted: exactly once);
- `teardown`: a resource (a dependency's "database session") was closed;
- `used_after_close`: a resource was used after its teardown (never allowed);
- `thread_returned`: a function running in a worker thread returned or raised;
- `done`: the work ran to its end;
- `bg_done`: a background task finished;
- `hook` (the middleware's `on_cancelled`) and `exit` (how the whole ASGI app ended).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, cast

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token

if TYPE_CHECKING:
    from ..servers.events import (
        ASGIApp,
        Receive,
        Scope,
        Send,
        log_cancellations_to_stderr,
        record,
        record_hook,
        recording_exit,
        serve_lifespan,
    )
else:  # the server process has tests/ on its path, and `frameworks` is a top-level package
    from servers.events import (
        ASGIApp,
        Receive,
        Scope,
        Send,
        log_cancellations_to_stderr,
        record,
        record_hook,
        recording_exit,
        serve_lifespan,
    )

__all__ = [
    "ASGIApp",
    "Receive",
    "Scope",
    "Send",
    "log_cancellations_to_stderr",
    "record",
    "record_hook",
    "recording_exit",
    "serve_lifespan",
]

CHUNK = b"chunk\n"
CHUNK_INTERVAL = 0.02
STEP = 0.01  # one unit of blocking work in a worker thread
ROLLBACK = 0.05  # what a thread still does with its resource once it saw the token
BACKGROUND_WORK = 0.3
NORMAL_BODY = "normal body: 0123456789"
NORMAL_HEADER = ("x-matrix", "normal")


def token_or_none() -> CancelToken | None:
    """The request's token, or None in the control apps (no middleware, no token)."""
    try:
        return current_token()
    except RuntimeError:
        return None


def is_cancelled(token: CancelToken | None) -> bool:
    return token is not None and token.cancelled


def record_cancelled(rid: str, token: CancelToken | None, exc: BaseException | None) -> None:
    record(
        rid,
        "stopped" if exc is None else "cancelled",
        exc="none" if exc is None else type(exc).__name__,
        token_cancelled=is_cancelled(token),
        reason=None if token is None else token.reason,
    )


def as_asgi(app: Any) -> ASGIApp:
    """A framework's app object (typed with its own scope types) as a plain ASGI callable."""
    return cast("ASGIApp", app)


def with_middleware(app: Any) -> ASGIApp:
    """Wrap a framework's ASGI callable the way users do, recording the hook."""
    return CancelOnDisconnectMiddleware(app, on_cancelled=record_hook)


async def slow_work(rid: str, seconds: float, cleanup: float = 0.0) -> None:
    """Sleep `seconds`; on cancellation await `cleanup` seconds of cleanup, then re-raise."""
    token = token_or_none()
    record(rid, "start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        if cleanup:
            await asyncio.sleep(cleanup)  # e.g. `await engine.abort(request_id)`
            record(rid, "cleanup_done", seconds=cleanup)
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


async def chunks(rid: str, seconds: float) -> AsyncIterator[bytes]:
    """A stream of `CHUNK`s for `seconds`."""
    token = token_or_none()
    record(rid, "start")
    try:
        for _ in range(int(seconds / CHUNK_INTERVAL)):
            yield CHUNK
            await asyncio.sleep(CHUNK_INTERVAL)
    except asyncio.CancelledError as exc:
        record_cancelled(rid, token, exc)
        raise
    except GeneratorExit:  # closed by the framework without a cancellation
        record(rid, "closed_by_framework", token_cancelled=is_cancelled(token))
        raise
    finally:
        record(rid, "finally")
    record(rid, "done")


class Resource:
    """A stand-in for a database session: it must not be used once it is closed."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.closed = False
        record(rid, "resource_open")

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


def blocking_work(rid: str, seconds: float, resource: Resource | None = None) -> str:
    """Sync work in a worker thread: steps of blocking work, polling the token between them.

    Once it sees the token, it still uses its resource for a moment (a rollback), as real code
    does: that use must not come after the resource's teardown.
    """
    token = token_or_none()  # the thread copied the request's context: the token is there
    record(rid, "start", in_thread=True)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(STEP)
            if resource is not None:
                resource.use("step")
            if is_cancelled(token):
                record_cancelled(rid, token, None)
                time.sleep(ROLLBACK)
                if resource is not None:
                    resource.use("rollback")
                return "stopped"
        record(rid, "done")
        return "sync done"
    finally:
        record(rid, "thread_returned")


async def polling_async_work(rid: str, seconds: float) -> str:
    """Async work that cannot be cancelled from the request's task (it runs on another loop,
    under `async_to_sync`): it stops by polling the token."""
    token = token_or_none()
    record(rid, "start", in_other_loop=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(STEP)
        if is_cancelled(token):
            record_cancelled(rid, token, None)
            return "stopped"
    record(rid, "done")
    return "async done"


async def background_work(rid: str) -> None:
    await asyncio.sleep(BACKGROUND_WORK)
    record(rid, "bg_done", token_cancelled=is_cancelled(token_or_none()))
