"""`CancelOnDisconnectMiddleware`: cancel the app the moment the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextvars
import math
import sys
from collections.abc import Awaitable
from typing import Any

from ._cycle import Cycle, OnCancelled, logger
from ._token import _current, _spawn_detached
from ._types import AnyASGIApp, Message, Receive, Scope, Send

_get_running_loop = asyncio.events._get_running_loop
_current_task = asyncio.current_task
_HAS_UNCANCEL = sys.version_info >= (3, 11)

DEFAULT_READ_AHEAD = 64 * 1024
DEFAULT_GRACE = 0.1


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


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
            raise TypeError(f"app must be an ASGI callable, got {_describe(app)}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(
                f"read_ahead must be an int of bytes >= 0, got {_describe(read_ahead)}"
            )
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not math.isfinite(grace)
            or grace < 0
        ):
            raise ValueError(
                f"grace must be a finite number of seconds >= 0, got {_describe(grace)}"
            )
        if on_cancelled is not None and not callable(on_cancelled):
            raise ValueError(
                f"on_cancelled must be callable or None, got {_describe(on_cancelled)}"
            )
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
            # An empty context: the watchers it starts must not inherit one request's context
            # variables (a request id in a log line) and apply them to another request.
            loop.call_soon(self._start_watchers, batch, context=contextvars.Context())
        batch[1].append(cycle)
        reset = _current.set(cycle)
        try:
            await self.app(scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            if cycle.cancel_issued:
                if _HAS_UNCANCEL and task.uncancel():  # type: ignore[union-attr,unused-ignore]
                    raise  # ours, and someone else's too
            elif not cycle._cancelled or (_HAS_UNCANCEL and task.cancelling()):  # type: ignore[union-attr,unused-ignore]
                raise  # not ours: server shutdown or an outer timeout
            # Otherwise the app raised it itself once the client had gone (raise_if_cancelled()
            # in a worker thread during the grace period or a shield): absorbed like ours.
        except BaseException:
            if cycle.cancel_issued and _HAS_UNCANCEL:
                task.uncancel()  # type: ignore[union-attr,unused-ignore]  # turned into an error
            raise
        else:
            if cycle.cancel_issued and _HAS_UNCANCEL:
                task.uncancel()  # type: ignore[union-attr,unused-ignore]  # app swallowed it
        finally:
            cycle.done = True
            if cycle._callbacks is not None:
                # Each holds a copy of the request's context, which holds the cycle: cleared
                # so that a finished request is freed by reference counting alone.
                cycle._callbacks.clear()
                cycle._callbacks = None
            try:
                if cycle.watcher is not None or cycle.grace_timer is not None or cycle.spawned:
                    await cycle.finish()
            finally:
                _current.reset(reset)
                # The finished cycle may outlive the request (a server's keep-alive timer
                # copied the context while the token was set; user code may keep the token):
                # drop what it references so that nothing big survives into older GC
                # generations, and leave the batch if it is still waiting there.
                if cycle.disconnect is None:
                    cycle.disconnect = _REQUEST_OVER  # a late receive() gets it, a send drops
                cycle.scope = cycle.real_receive = cycle.real_send = cycle.task = None  # type: ignore[assignment]
                entries = batch[1]
                if entries and entries[-1] is cycle:
                    entries.pop()

    def _start_watchers(self, batch: tuple[asyncio.AbstractEventLoop, list[_AsyncioCycle]]) -> None:
        if self._batch is batch:
            self._batch = None
        loop = batch[0]
        for cycle in batch[1]:
            if not cycle.done and cycle.disconnect is None:
                cycle.watcher = loop.create_task(cycle.watch())


_CLOSED: frozenset[asyncio.Task[object]] = frozenset()
_GRACE_HOPS = 3
_REQUEST_OVER: Message = {"type": "http.disconnect"}


class _AsyncioCycle(Cycle):
    __slots__ = ()

    # The backend slots of Cycle, as asyncio fills them.
    task: asyncio.Task[Any]
    lot: list[asyncio.Future[None]] | None
    watcher: asyncio.Task[None] | None
    grace_timer: asyncio.TimerHandle | None
    spawned: set[asyncio.Task[object]] | frozenset[asyncio.Task[object]] | None

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
        task = self.task
        if _HAS_UNCANCEL and task.cancelling():  # type: ignore[attr-defined,unused-ignore]
            # Someone else is cancelling the app (server shutdown, an anyio scope): a second
            # cancel would interrupt the cleanup it is running. Ask again once that is over.
            task.get_loop().call_later(0.005, self._cancel_app)
            return
        self.cancel_issued = True
        task.cancel()  # once: edge-triggered, so the app's cleanup can await freely

    def _cancel_app_soon(self) -> None:
        # From inside the app (a shield() exit): if the app then returns without awaiting, a
        # cancel issued now would land in the server's code instead. One hop lets `done` win.
        if not self.done:
            self.task.get_loop().call_soon(self._cancel_app)

    def schedule_grace(self) -> None:
        self.grace_timer = self.task.get_loop().call_later(
            self.config.grace, self._grace_over, _GRACE_HOPS
        )

    def _grace_over(self, hops: int) -> None:
        # A few more loop iterations before cancelling: on a loop that was busier than `grace`
        # (a GC pause, a burst of engine outputs), the app's own reaction may still be queued:
        # vLLM's with_cancellation needs three steps (listener ends, asyncio.wait completes,
        # the wrapper resumes) before it cancels its inner handler task. Cancelling the
        # wrapper earlier would orphan that task.
        if hops and not self.done:
            self.task.get_loop().call_soon(self._grace_over, hops - 1)
        else:
            self._request_cancel()

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def _spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> object:
            return await awaitable

        spawned = self.spawned
        if self.done and not isinstance(spawned, set):
            # The request is over (or finishing without a finish() to wait for it).
            _spawn_detached(awaitable)
            return
        if spawned is None or not isinstance(spawned, set):
            spawned = self.spawned = set()
        spawned.add(self.task.get_loop().create_task(run()))

    async def finish(self) -> None:
        """Cancel the watcher and wait for callback tasks, even through a server shutdown."""
        interrupted = False
        if self.grace_timer is not None:
            self.grace_timer.cancel()
            self.grace_timer = None
        watcher = self.watcher
        if watcher is not None:
            # Dropped first: the cancelled task's traceback holds watch()'s frame, which
            # holds this cycle, so keeping it would leave a reference cycle for the GC.
            self.watcher = None
            watcher.cancel()
            interrupted = await _wait_out({watcher})
        spawned = self.spawned
        while isinstance(spawned, set) and spawned:
            # Callbacks' tasks (engine aborts) must finish: the app's cleanup may rely on them.
            tasks = set(spawned)
            interrupted = await _wait_out(tasks) or interrupted
            spawned -= tasks
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    logger.error("asgi_cancel: on_cancel task failed", exc_info=task.exception())
        self.spawned = _CLOSED
        if interrupted:
            raise asyncio.CancelledError


async def _wait_out(tasks: set[asyncio.Task[Any]]) -> bool:
    """Wait until `tasks` are done; return whether we were cancelled meanwhile.

    Cancelled from outside (server shutdown), cancel the tasks and still wait for them to
    end, so that none outlives the request.
    """
    interrupted = False
    while tasks:
        try:
            _, tasks = await asyncio.wait(tasks)
        except asyncio.CancelledError:
            interrupted = True
            for task in tasks:
                task.cancel()
    return interrupted
