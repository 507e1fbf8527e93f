"""The trio backend: a nursery for the watcher and the timers, a cancel scope for the app."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from time import monotonic
from types import TracebackType
from typing import Any, Protocol

import trio

from ._backend import Served
from ._cycle import Cycle
from ._responses import COMPLETION_TIMEOUT, complete_stopped, logger
from ._session import Session
from ._states import Options
from ._tracking import DEADLINE_EXCEEDED, DEADLINE_STATUS, Tracking
from ._watcher import watch_within
from .types import AnyASGIApp, Receive, Scope, Send

if sys.version_info < (3, 11):  # trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

__all__ = ["LIBRARY", "TrioBackend"]


class TrioOptions(Options, Protocol):
    app: AnyASGIApp


class TrioBackend:
    """Runs requests on trio for one middleware. Every request is watched from its start (a
    nursery costs little next to trio's own per-task cost)."""

    __slots__ = ("app", "options", "tracking")

    def __init__(self, options: TrioOptions, tracking: Tracking | None) -> None:
        self.app = options.app
        self.options = options
        self.tracking = tracking

    async def run(self, scope: Scope, receive: Receive, send: Send) -> Any:
        """Run one request (an HTTP request or a websocket session); returns what the app
        returned."""
        request: Cycle[TrioLane] | Session[TrioLane]
        if scope["type"] == "websocket":
            request = Session(scope, receive, send, self.options, TrioLane)
        else:
            request = Cycle(scope, receive, send, self.options, TrioLane)
        tracking = self.tracking
        if tracking is not None:  # ids or deadlines: only when the options ask for them
            refused = tracking.begin(request)
            if refused is not None:
                request.finished()
                await refused
                return None
            send = request.real_send  # its completion, too, carries the request's id
        lane = request.ensure_lane()
        error: BaseException | None = None
        result = None
        try:
            async with trio.open_nursery() as nursery:
                lane.nursery = nursery
                if tracking is not None:
                    lane.track(tracking)
                nursery.start_soon(watch_within, lane.watch_scope, request)
                try:
                    with lane.app_scope:
                        request.app = self.app(scope, request.receive, request.send)
                        result = await request.app
                except asyncio.CancelledError:
                    # raise_if_cancelled() in a worker thread: asyncio's exception, trio's
                    # meaning.
                    if request.stopped_with is None:
                        raise
                except BaseException as exc:  # re-raised below, outside the nursery's group
                    error = exc
                finally:
                    request.finished()
                    lane.close()  # (the nursery waits for the lane's tasks)
        except BaseExceptionGroup as group:
            # An outside cancellation also cancels the watcher; its Cancelled must not replace
            # the app's own exception.
            _, rest = group.split(trio.Cancelled)
            if error is None or rest is not None:
                raise
        finally:
            lane.nursery = None
        if error is not None:
            raise error
        if request.stopped_with is not None:
            with trio.move_on_after(COMPLETION_TIMEOUT) as bound:
                if isinstance(request, Session):
                    await request.complete(send)
                else:
                    await complete_stopped(request, receive, send)
            if bound.cancelled_caught:
                logger.debug("the server's send did not return; not completing")
        return result


class TrioLane:
    """One request's trio operations: parked callers, the app's cancel scope, the nursery."""

    __slots__ = (
        "app_scope",
        "cycle",
        "grace",
        "nursery",
        "parked",
        "thread",
        "timers",
        "tracking",
        "trio_token",
        "watch_scope",
        "watching",
    )

    def __init__(self, cycle: Served) -> None:
        self.cycle = cycle
        self.grace = cycle.options.grace
        self.parked = trio.lowlevel.ParkingLot()
        self.app_scope = trio.CancelScope()
        self.watch_scope = trio.CancelScope()
        self.watching = True  # started with the app: until the watcher returns
        self.timers: list[trio.CancelScope] = []
        self.nursery: trio.Nursery | None = None
        self.tracking: Tracking | None = None
        self.trio_token = trio.lowlevel.current_trio_token()
        self.thread = threading.get_ident()

    def track(self, tracking: Tracking) -> None:
        """Make the request findable by id, and start its deadline's timer if it has one."""
        self.tracking = tracking
        tracking.register(self.cycle, self.trio_token.run_sync_soon)
        deadline = self.cycle.cancel_scope.deadline
        if deadline is not None:
            self.call_later(deadline - monotonic(), self._deadline_passed)

    def _deadline_passed(self) -> None:
        self.cycle.stop(DEADLINE_EXCEEDED, DEADLINE_STATUS)

    def close(self) -> None:
        """The app has returned: end the watcher and the timers (the nursery waits for them),
        and leave the registry."""
        self.watch_scope.cancel()
        for timer in self.timers:
            timer.cancel()
        if self.tracking is not None:
            self.tracking.unregister(self.cycle)

    # -- Lane ------------------------------------------------------------------------------------
    async def park(self) -> None:
        await self.parked.park()

    def wake(self) -> None:
        if self.parked:
            self.parked.unpark_all()

    async def checkpoint(self) -> None:
        # Trio's cancellation is level-triggered: a cancelled app meets it here, or at its next
        # checkpoint anyway, a worker thread's included.
        await trio.lowlevel.checkpoint()

    def enter(self) -> object:
        return self.app_scope.__enter__()

    def leave(
        self,
        entered: object,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        return bool(self.app_scope.__exit__(exc_type, exc, traceback))

    def in_app_task(self) -> bool:
        return True

    def watch_now(self) -> bool:
        return self.watching

    def watch_ended(self) -> None:
        self.watching = False
        self.wake()

    def call_later(self, delay: float, callback: Callable[[], object]) -> trio.CancelScope:
        # Made here, not in the task: cancelled before it starts, it still ends.
        timer = trio.CancelScope()
        self.timers.append(timer)
        if self.nursery is not None:
            deadline = trio.current_time() + max(0.0, delay)
            self.nursery.start_soon(_call_at, timer, deadline, callback)
        return timer

    def after_shield(self, callback: Callable[[], object]) -> None:
        if threading.get_ident() == self.thread:
            callback()  # a cancelled scope: the app's next checkpoint raises, never outside it
        else:  # the shield() block was sync code in a worker thread
            self.trio_token.run_sync_soon(callback)

    def after_grace(self, callback: Callable[[], object]) -> trio.CancelScope:
        return self.call_later(self.grace, callback)

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        self.trio_token.run_sync_soon(callback)

    def spawn(self, awaitable: Awaitable[object]) -> None:
        if self.nursery is None:
            LIBRARY.spawn_detached(awaitable)
            return
        self.nursery.start_soon(_logged, awaitable)

    def cancel_app(self) -> bool:
        self.app_scope.cancel()
        return True

    def withdraw(self) -> int:
        return 0  # a cancel scope's cancellation ends with its block

    def cancelled_elsewhere(self) -> bool:
        return False

    def reacting(self) -> bool:
        return False


async def _call_at(
    timer: trio.CancelScope, deadline: float, callback: Callable[[], object]
) -> None:
    with timer:
        await trio.sleep_until(deadline)
        callback()


async def _logged(awaitable: Awaitable[object]) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("on_cancel task failed")


class _Library:
    """What code outside a request needs from trio while it runs."""

    def event(self) -> trio.Event:
        return trio.Event()

    def shielded(self) -> contextlib.AbstractContextManager[object]:
        # A cancel scope, once cancelled, cancels every later checkpoint in it (a cancellation
        # issued while the app waited for a worker thread would land inside a shield() block):
        # a shielded scope defers it to the block's end, trio's own way.
        return trio.CancelScope(shield=True)

    async def wait_futures(
        self, futures: Iterable[concurrent.futures.Future[bool]], seconds: float
    ) -> tuple[set[concurrent.futures.Future[bool]], set[concurrent.futures.Future[bool]]]:
        done, pending = await trio.to_thread.run_sync(
            concurrent.futures.wait, list(futures), seconds
        )
        return set(done), set(pending)

    def spawn_detached(self, awaitable: Awaitable[object]) -> None:
        trio.lowlevel.spawn_system_task(_logged, awaitable)


LIBRARY = _Library()
