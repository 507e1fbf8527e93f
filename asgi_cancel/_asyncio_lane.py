"""`AsyncioLane`: one request's asyncio operations (parked callers, timers, the watcher, the
tasks it started), and the one cancellation of its task, when the task can take it."""

from __future__ import annotations

import _asyncio
import asyncio
import contextvars
import sys
from collections.abc import Awaitable, Callable
from time import monotonic
from types import TracebackType
from typing import Any

from ._asyncio_task import in_anyio_shield, reacting, thread_future, woken
from ._backend import Served, Timer
from ._responses import logger
from ._servers import steppable
from ._stepped import HandStepped
from ._tracking import DEADLINE_EXCEEDED, DEADLINE_STATUS, Tracking
from ._watcher import watcher as watcher_of

__all__ = ["NO_CONTEXT", "AsyncioLane", "awaited", "cancelling", "current_task", "uncancel"]

if sys.version_info >= (3, 11):

    def cancelling(task: asyncio.Task[Any]) -> int:
        return task.cancelling()

    def uncancel(task: asyncio.Task[Any]) -> int:
        return task.uncancel()

else:  # Python 3.10 cannot tell cancellations apart: nobody else's is ever seen

    def cancelling(task: asyncio.Task[Any]) -> int:
        return 0

    def uncancel(task: asyncio.Task[Any]) -> int:
        return 0


_get_running_loop = asyncio.events._get_running_loop
# asyncio.current_task() in C: on 3.10 and 3.11 the public one is Python around this dict.
_current_tasks: dict[object, Any] = getattr(_asyncio, "_current_tasks", {})
current_task: Callable[[], Any] = getattr(
    _asyncio, "current_task", lambda: _current_tasks.get(_get_running_loop())
)


def task_here() -> Any:
    """The running task, or None in a worker thread (where 3.12's current_task() raises)."""
    try:
        return current_task()
    except RuntimeError:
        return None


# What the watcher and the timers run in: they must not carry one request's context variables
# (a request id in a log line) into code that runs for it, nor keep its context alive.
NO_CONTEXT = contextvars.Context()
_GRACE_HOPS = 3


class AsyncioLane:
    """One request's asyncio operations: its task, parked callers, watcher, timers, tasks.

    The watcher (`_watcher.watch`) runs in a task of its own, except on the servers whose
    `receive()` awaits nothing but futures of the running loop (`_servers.steppable()`): there
    it is stepped by hand (`_stepped.HandStepped`), without a task.
    """

    __slots__ = (
        "cycle",
        "deadline_timer",
        "later",
        "parked",
        "spawned",
        "task",
        "tracking",
        "watcher",
        "watching",
    )

    def __init__(self, cycle: Served) -> None:
        self.cycle = cycle
        # The request's own task: once the app first waited, the one that ran its first step
        # (`watch_after` sets it); before that, the caller's, unless a worker thread's.
        task = cycle.app_task
        self.task: asyncio.Task[Any] = task if task is not None else task_here()
        self.watcher: HandStepped | asyncio.Task[None] | None = None
        self.watching = False  # the watcher started, and has not ended
        self.parked: list[asyncio.Future[None]] | None = None  # app callers waiting
        self.spawned: set[asyncio.Task[object]] | None = None  # on_cancel callbacks' tasks
        self.later: asyncio.TimerHandle | None = None  # look again at a cancellation
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.tracking: Tracking | None = None

    def track(self, tracking: Tracking) -> None:
        """Make the request findable by id, and arm its one deadline timer if it has one."""
        self.tracking = tracking
        loop = self.task.get_loop()
        tracking.register(self.cycle, loop.call_soon_threadsafe)
        deadline = self.cycle.cancel_scope.deadline
        if deadline is not None:
            self.deadline_timer = self.call_later(deadline - monotonic(), self._deadline_passed)

    def _deadline_passed(self) -> None:
        self.deadline_timer = None
        self.cycle.stop(DEADLINE_EXCEEDED, DEADLINE_STATUS)

    def watch_now(self) -> bool:
        cycle = self.cycle
        if self.watcher is None and not self.watching and cycle.watchable():
            self.watching = True
            loop = self.task.get_loop()
            if steppable(cycle.real_receive):
                watcher = self.watcher = HandStepped(loop, watcher_of(cycle))
                watcher.step()
            else:
                # In a context of its own: the task must not keep the request's alive.
                self.watcher = contextvars.Context().run(loop.create_task, watcher_of(cycle))
        return self.watching

    def watch_ended(self) -> None:
        self.watching = False
        self.wake()

    # -- Lane --------------------------------------------------------------------------------
    async def park(self) -> None:
        future = self.task.get_loop().create_future()
        if self.parked is None:
            self.parked = []
        self.parked.append(future)
        try:
            await future
        finally:
            if not future.done() and self.parked is not None:
                self.parked.remove(future)

    def wake(self) -> None:
        parked = self.parked
        if parked:
            self.parked = None
            for future in parked:
                if not future.done():
                    future.set_result(None)

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def enter(self) -> object:
        # A turn's lane: its task is the caller's, which `__init__` took.
        return None

    def leave(
        self,
        entered: object,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        return False  # the turn's scope tells whether its own cancellation ended it

    def in_app_task(self) -> bool:
        return self.task is task_here()

    def call_later(self, delay: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        return self.task.get_loop().call_later(delay, callback, context=NO_CONTEXT)

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        self.task.get_loop().call_soon_threadsafe(callback, context=NO_CONTEXT)

    def after_shield(self, callback: Callable[[], object]) -> None:
        # Soon, not now: the block may be sync code in a worker thread, or the app may return
        # right after it without awaiting: a cancellation issued now would then land in the
        # server's code. One hop lets the request's end win.
        self.call_soon_threadsafe(callback)

    def after_grace(self, callback: Callable[[], object]) -> Timer:
        # A few more loop iterations after `grace`: on a loop that was busier than `grace` (a
        # GC pause, a burst of engine outputs), the app's own reaction may still be queued:
        # vLLM's with_cancellation needs three steps (listener ends, asyncio.wait completes,
        # the wrapper resumes) before it cancels its inner handler task. Cancelling the
        # wrapper earlier would orphan that task.
        loop = self.task.get_loop()

        def hop(hops: int) -> None:
            if hops:
                loop.call_soon(hop, hops - 1, context=NO_CONTEXT)
            else:
                callback()

        grace = self.cycle.options.grace
        return loop.call_later(grace, hop, _GRACE_HOPS, context=NO_CONTEXT)

    def spawn(self, awaitable: Awaitable[object]) -> None:
        if self.spawned is None:
            self.spawned = set()
        self.spawned.add(self.task.get_loop().create_task(awaited(awaitable)))

    def cancel_app(self) -> bool:
        task = self.task
        scope = self.cycle.cancel_scope
        if cancelling(task):
            # Someone else is cancelling the app (server shutdown, an anyio scope, the app's
            # own task group): a second cancel would cut the cleanup it runs short. Look again
            # after `grace`, in case the app caught that cancellation and went on working.
            self.later = self.call_later(self.cycle.options.grace, scope.deliver)
            return False
        if thread_future(task, self.cycle.app) is not None or in_anyio_shield(task):
            # The app waits for a worker thread (a threadpool endpoint, sync_to_async) or runs
            # a framework's cleanup in an anyio shielded scope (FastAPI's dependency exits): a
            # cancel now would unwind the request while the thread still uses its resources,
            # or cut that cleanup short. The token has fired, so code that checks it stops;
            # look again when the app's current wait ends (done callbacks run in the order they
            # were added: after the task's own wake-up), so that the cancellation lands at its
            # first await outside them (no polling).
            waits_on = getattr(task, "_fut_waiter", None)
            if waits_on is None:
                task.get_loop().call_soon(scope.deliver, context=NO_CONTEXT)
            else:
                waits_on.add_done_callback(lambda _: scope.deliver(), context=NO_CONTEXT)
            return False
        task.cancel()  # once: edge-triggered, so the app's cleanup can await freely
        return True

    def withdraw(self) -> int:
        return uncancel(self.task)

    def cancelled_elsewhere(self) -> bool:
        return bool(cancelling(self.task))

    def reacting(self) -> bool:
        return reacting(self.task, self.cycle)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> bool:
        """The app has returned: stop the timers and a watcher stepped by hand, leave the
        registry. Returns whether tasks the request started are left (`wait_for_tasks()`)."""
        if isinstance(self.watcher, HandStepped):
            self.watcher.close()
        if self.later is not None:
            self.later.cancel()
        if self.tracking is not None:
            self.tracking.unregister(self.cycle)
            if self.deadline_timer is not None:
                self.deadline_timer.cancel()
        return isinstance(self.watcher, asyncio.Task) or bool(self.spawned)

    async def wait_for_tasks(self, outside: bool) -> None:
        """End the watcher task, and wait for the tasks `on_cancel` callbacks started, even
        through a server shutdown: none outlives the request."""
        watcher, self.watcher = self.watcher, None
        interrupted: asyncio.CancelledError | None = None
        if isinstance(watcher, asyncio.Task):
            interrupted = await _end_watcher(watcher, outside)
        spawned = self.spawned
        while spawned:
            # Callbacks' tasks (engine aborts) must finish: the app's cleanup may rely on them.
            tasks = list(spawned)
            interrupted = await _wait_out(tasks) or interrupted
            spawned.difference_update(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    logger.error("on_cancel task failed", exc_info=task.exception())
        if interrupted is not None:
            # That very cancellation, not a new one: an anyio scope knows its own by its
            # message, and would let a new one escape it.
            raise interrupted


async def awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable


async def _end_watcher(watcher: asyncio.Task[None], outside: bool) -> asyncio.CancelledError | None:
    """End a watcher task; the cancellation that came meanwhile, if one did. Under an outside
    cancellation it is cancelled and not waited for: it ends on its next step, and the
    cancellation is re-raised at once (uvicorn stops its loop a few iterations after cancelling
    the requests at shutdown)."""
    if outside or not woken(watcher):
        watcher.cancel()
    else:
        # Its wait is over (uvicorn answers its receive() once the response is complete): its
        # next step, already due, ends it, with no CancelledError through its frames.
        watcher.get_loop().call_soon(watcher.cancel)
    return None if outside else await _wait_out([watcher])


async def _wait_out(tasks: list[asyncio.Task[Any]]) -> asyncio.CancelledError | None:
    """Wait until `tasks` are done; return the cancellation that came meanwhile, if one did.

    Cancelled from outside (server shutdown, an anyio scope that cancels again on every loop
    iteration), cancel the tasks and still wait for them to end, so that none outlives the
    request. Done-ness is re-checked after every wake-up, so a level-triggered cancellation
    cannot keep us waiting on tasks that already ended.
    """
    interrupted: asyncio.CancelledError | None = None
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
        except asyncio.CancelledError as exc:
            interrupted = exc
            for task in pending:
                task.cancel()
        finally:
            for task in pending:
                task.remove_done_callback(wake)
        pending = [task for task in pending if not task.done()]
    return interrupted
