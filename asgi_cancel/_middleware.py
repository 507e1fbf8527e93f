"""`CancelOnDisconnectMiddleware`: cancel the app the moment the HTTP client goes away."""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Awaitable
from typing import Any

from ._cycle import Cycle, OnCancelled, describe, logger
from ._token import _current
from ._types import AnyASGIApp, Receive, Scope, Send

_get_running_loop = asyncio.events._get_running_loop
_current_task = asyncio.current_task
_HAS_UNCANCEL = sys.version_info >= (3, 11)

DEFAULT_READ_AHEAD = 64 * 1024
DEFAULT_GRACE = 0.1


class CancelOnDisconnectMiddleware:
    """Cancel an ASGI app's work for a request the moment its HTTP client disconnects.

    After the request body is read (bounded read-ahead), the middleware becomes the only caller
    of the server's `receive`. When `http.disconnect` arrives before the response is complete,
    it fires the request's `CancelToken` and cancels the app task once (`Task.cancel()` on
    asyncio, a cancel scope on trio), waits for the app to finish its cleanup, and returns
    normally. Disconnects are cached and replayed to every `receive()` caller in the app.

    Only `http` scopes are handled; `websocket` and `lifespan` pass straight through.

    Args:
        app: the ASGI application to wrap.
        read_ahead: how many request-body bytes the middleware may read ahead of the app, so
            that a body the app has not read yet does not hide a disconnect. Past it, the
            server's own backpressure applies as without the middleware. Default 64 KiB.
        grace: seconds to let an app that is itself listening for `http.disconnect` (a pending
            `receive()` after the body) react before the middleware cancels what still runs.
            Default 0.1.
        on_cancelled: called once per cancelled request, in the event loop, as
            `on_cancelled(scope, reason=..., elapsed=..., response_started=...)`; `elapsed` is
            seconds from the request's start to the disconnect. For metrics exporters.

    Raises:
        TypeError: `app` is not callable.
        ValueError: an option is invalid; the message names it.
    """

    def __init__(
        self,
        app: AnyASGIApp,
        *,
        read_ahead: int = DEFAULT_READ_AHEAD,
        grace: float = DEFAULT_GRACE,
        on_cancelled: OnCancelled | None = None,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI callable, got {describe(app)}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead must be an int of bytes >= 0, got {describe(read_ahead)}")
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not math.isfinite(grace)
            or grace < 0
        ):
            raise ValueError(
                f"grace must be a finite number of seconds >= 0, got {describe(grace)}"
            )
        if on_cancelled is not None and not callable(on_cancelled):
            raise ValueError(f"on_cancelled must be callable or None, got {describe(on_cancelled)}")
        self.app = app
        self.read_ahead = read_ahead
        self.grace = float(grace)
        self.on_cancelled = on_cancelled
        # Requests started during the current event-loop iteration, per loop: one call_soon
        # per iteration (not per request) starts watchers for those that are still running.
        self._batch: tuple[asyncio.AbstractEventLoop, list[_AsyncioCycle]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = _get_running_loop()
        if loop is None:
            from ._trio import run_trio

            await run_trio(self, scope, receive, send)
            return
        cycle = _AsyncioCycle(scope, receive, send, self)
        cycle.task = task = _current_task(loop)  # type: ignore[assignment]
        # Watch only requests that yield to the loop: one that runs to the end in a single
        # step (a hello world) costs no task, no queue and no timer.
        batch = self._batch
        if batch is None or batch[0] is not loop:
            batch = self._batch = (loop, [])
            loop.call_soon(self._start_watchers, batch)
        batch[1].append(cycle)
        reset = _current.set(cycle)
        try:
            await self.app(scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            if not cycle.cancel_issued:
                raise  # not ours: server shutdown or an outer timeout
            if _HAS_UNCANCEL and task.uncancel():  # type: ignore[union-attr,unused-ignore]
                raise  # ours, and someone else's too
        else:
            if cycle.cancel_issued and _HAS_UNCANCEL:
                task.uncancel()  # type: ignore[union-attr,unused-ignore]  # app swallowed it
        finally:
            cycle.done = True
            if cycle.watcher is not None or cycle.grace_timer is not None or cycle.spawned:
                await cycle.finish()
            _current.reset(reset)

    def _start_watchers(self, batch: tuple[asyncio.AbstractEventLoop, list[_AsyncioCycle]]) -> None:
        if self._batch is batch:
            self._batch = None
        loop = batch[0]
        for cycle in batch[1]:
            if not cycle.done and cycle.disconnect is None:
                cycle.watcher = loop.create_task(cycle.watch())


class _AsyncioCycle(Cycle):
    __slots__ = ()

    # The backend slots of Cycle, as asyncio fills them.
    task: asyncio.Task[Any]
    lot: list[asyncio.Future[None]] | None
    watcher: asyncio.Task[None] | None
    grace_timer: asyncio.TimerHandle | None
    spawned: set[asyncio.Task[object]] | None

    async def park(self) -> None:
        future = self.task.get_loop().create_future()
        if self.lot is None:
            self.lot = []
        self.lot.append(future)
        try:
            await future
        finally:
            if not future.done() and self.lot is not None:
                self.lot.remove(future)

    def wake(self) -> None:
        lot = self.lot
        if lot:
            self.lot = None
            for future in lot:
                if not future.done():
                    future.set_result(None)

    def _cancel_app(self) -> None:
        if self.done or self.cancel_issued:
            return
        self.cancel_issued = True
        self.task.cancel()  # once: edge-triggered, so the app's cleanup can await freely

    def schedule_grace(self) -> None:
        loop = self.task.get_loop()
        self.grace_timer = loop.call_later(self.config.grace, self._request_cancel)

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def _spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> object:
            return await awaitable

        if self.spawned is None:
            self.spawned = set()
        self.spawned.add(self.task.get_loop().create_task(run()))

    async def finish(self) -> None:
        if self.grace_timer is not None:
            self.grace_timer.cancel()
        watcher = self.watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
            await asyncio.wait((watcher,))
        while self.spawned:
            # Callbacks' tasks (engine aborts) must finish: the app's cleanup may rely on them.
            spawned, self.spawned = self.spawned, None
            await asyncio.wait(spawned)
            for task in spawned:
                if not task.cancelled() and task.exception() is not None:
                    logger.error("asgi_cancel: on_cancel task failed", exc_info=task.exception())
