"""`CancelOnDisconnectMiddleware`: cancel the app the moment the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextvars
import math
import sys
from collections.abc import Awaitable
from typing import Any

from ._cycle import Cycle, OnCancelled, logger, send_cancelled_response
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
        if cycle._cancelled and not cycle.response_started:
            await send_cancelled_response(scope, send)

    def _start_watchers(self, batch: tuple[asyncio.AbstractEventLoop, list[_AsyncioCycle]]) -> None:
        if self._batch is batch:
            self._batch = None
        loop = batch[0]
        for cycle in batch[1]:
            if not cycle.done and cycle.disconnect is None:
                cycle.watcher = loop.create_task(cycle.watch())


_to_thread_code = asyncio.to_thread.__code__
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
        loop = task.get_loop()
        if _HAS_UNCANCEL and task.cancelling():  # type: ignore[attr-defined,unused-ignore]
            # Someone else is cancelling the app (server shutdown, an anyio scope, the app's
            # own task group): a second cancel would cut the cleanup it runs short. Look again
            # after `grace`, in case the app caught that cancellation and went on working.
            self.grace_timer = loop.call_later(self.config.grace, self._cancel_app)
            return
        if _protected(task):
            # The app waits for a worker thread (a threadpool endpoint, sync_to_async) or is
            # in an anyio shielded scope (a framework's cleanup): a cancel now would unwind
            # the request (dependency teardown, exit stacks) while the thread still uses its
            # resources, or cut that cleanup short. The token has fired, so code that checks
            # it stops; look again each time the app's current wait ends, so that the
            # cancellation lands at its first await outside them.
            waiter: asyncio.Future[Any] | None = getattr(task, "_fut_waiter", None)
            if waiter is None:
                loop.call_soon(self._cancel_app)
            else:
                waiter.add_done_callback(self._wait_ended)
            return
        self.cancel_issued = True
        task.cancel()  # once: edge-triggered, so the app's cleanup can await freely

    def _wait_ended(self, future: asyncio.Future[Any]) -> None:
        # Runs after the app task's own wake-up: the app has resumed and reached its next
        # await (or finished) by now.
        self._cancel_app()

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
        # A few more loop iterations before deciding: on a loop that was busier than `grace`
        # (a GC pause, a burst of engine outputs), the app's own reaction may still be queued:
        # vLLM's with_cancellation needs three steps (listener ends, asyncio.wait completes,
        # the wrapper resumes) before it cancels its inner handler task. Cancelling the
        # wrapper earlier would orphan that task.
        self.grace_timer = None
        if self.done:
            return
        if hops:
            self.task.get_loop().call_soon(self._grace_over, hops - 1)
        elif _reacting(self.task, self):
            # The app reacted by cancelling its own work (Django, Quart, Starlette's stream
            # listener): that cleanup is the app's, however long it takes. No second cancel.
            logger.debug("asgi_cancel: the app handles the disconnect itself")
        else:
            self._request_cancel()  # it listened and ignored the disconnect

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
            interrupted = await _wait_out([watcher])
        spawned = self.spawned
        while isinstance(spawned, set) and spawned:
            # Callbacks' tasks (engine aborts) must finish: the app's cleanup may rely on them.
            tasks = list(spawned)
            interrupted = await _wait_out(tasks) or interrupted
            spawned.difference_update(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    logger.error("asgi_cancel: on_cancel task failed", exc_info=task.exception())
        self.spawned = _CLOSED
        if interrupted:
            raise asyncio.CancelledError


async def _wait_out(tasks: list[asyncio.Task[Any]]) -> bool:
    """Wait until `tasks` are done; return whether we were cancelled meanwhile.

    Cancelled from outside (server shutdown, an anyio scope that cancels again on every loop
    iteration), cancel the tasks and still wait for them to end, so that none outlives the
    request. Done-ness is re-checked after every wake-up, so a level-triggered cancellation
    cannot keep us waiting on tasks that already ended.
    """
    interrupted = False
    pending = [task for task in tasks if not task.done()]
    while pending:
        waiter: asyncio.Future[None] = pending[0].get_loop().create_future()

        def wake(_: object, waiter: asyncio.Future[None] = waiter) -> None:
            if not waiter.done():
                waiter.set_result(None)

        for task in pending:
            task.add_done_callback(wake)
        try:
            await waiter
        except asyncio.CancelledError:
            interrupted = True
            for task in pending:
                task.cancel()
        finally:
            for task in pending:
                task.remove_done_callback(wake)
        pending = [task for task in pending if not task.done()]
    return interrupted


def _protected(task: asyncio.Task[Any]) -> bool:
    """Whether `task` waits for a worker thread or runs in an anyio shielded scope.

    Recognised threads: futures chained to a `concurrent.futures.Future`
    (`loop.run_in_executor`, `asyncio.to_thread`, Litestar's `sync_to_thread`) and the await
    chains of anyio's worker threads (Starlette's `run_in_threadpool`, FastAPI `def`
    endpoints and dependencies, `anyio.to_thread.run_sync`) and of asgiref's
    `sync_to_async`, from the call to the thread's return. Runs only after a disconnect.
    """
    # `_fut_waiter` is the future a task is suspended on, in both Task implementations
    # since Python 3.4 (anyio's cancel scopes read it too).
    waiter = getattr(task, "_fut_waiter", None)
    for callback, *_ in getattr(waiter, "_callbacks", None) or ():
        if getattr(callback, "__qualname__", "") == "_chain_future.<locals>._call_check_cancel":
            return True
    codes = _thread_codes()
    awaitable: Any = task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        if code is not None and code in codes:
            return True
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return _in_anyio_shield(task)


def _in_anyio_shield(task: asyncio.Task[Any]) -> bool:
    # A native Task.cancel() goes through anyio's shields (FastAPI closes `yield`
    # dependencies in one): respect them as anyio's own cancellation would.
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    try:
        state = anyio_asyncio._task_states.get(task)  # type: ignore[union-attr]
        scope = state.cancel_scope if state is not None else None
        while scope is not None:
            if scope._shield:
                return True
            scope = scope._parent_scope
    except (AttributeError, TypeError):  # another anyio version: threads are still covered
        return False
    return False


def _thread_codes() -> set[object]:
    # Only modules the app already imported: a disconnect never imports anything.
    codes: set[object] = {_to_thread_code}
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    if anyio_asyncio is not None:
        backend = getattr(anyio_asyncio, "AsyncIOBackend", None)
        method = getattr(backend, "run_sync_in_worker_thread", None)
        codes.add(getattr(getattr(method, "__func__", method), "__code__", None))
    asgiref_sync = sys.modules.get("asgiref.sync")
    if asgiref_sync is not None:
        call = vars(getattr(asgiref_sync, "SyncToAsync", object)).get("__call__")
        codes.add(getattr(call, "__code__", None))
    codes.discard(None)
    return codes


def _reacting(task: asyncio.Task[Any], token: object) -> bool:
    """Whether the app is cancelling its own work: the app task, or a task it awaits.

    Django awaits the handler task it cancelled, Quart gathers them, anyio task groups
    (Starlette's stream listener, sse-starlette) cancel the app task itself. Python 3.10 has
    no `Task.cancelling()`: there, nothing counts as a reaction.
    """
    if not _HAS_UNCANCEL:
        return False  # pragma: no cover (3.10)
    seen: list[object] = []
    pending: list[Any] = [task]
    while pending:
        current = pending.pop()
        if current is None or any(current is item for item in seen) or len(seen) > 64:
            continue
        seen.append(current)
        if isinstance(current, asyncio.Task):
            if current.cancelling():  # type: ignore[attr-defined,unused-ignore]
                return True
            pending.append(getattr(current, "_fut_waiter", None))
        else:
            # asyncio.gather's future holds its children.
            pending.extend(getattr(current, "_children", ()))
    if sys.version_info >= (3, 12):
        # Tasks the app started and does not await directly (a task group's children).
        for other in asyncio.all_tasks(task.get_loop()):
            if other.cancelling() and other.get_context().get(_current) is token:
                return True
    return False
