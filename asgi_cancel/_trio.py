"""The trio driver: a nursery for the watcher, a cancel scope for the app."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from collections.abc import Awaitable
from time import monotonic
from typing import Any

import trio

from ._cycle import Cycle, Options, State, logger, new_cycle
from ._responses import COMPLETION_TIMEOUT, complete_cancelled
from ._tracking import DEADLINE_EXCEEDED, DEADLINE_STATUS, Tracking
from .types import AnyASGIApp, Receive, Scope, Send

if sys.version_info < (3, 11):  # trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

_FINISHED = State.FINISHED


class TrioDriver:
    """Runs requests on trio for one middleware instance. Every request is watched from its
    start (a nursery costs little next to trio's own per-task cost)."""

    __slots__ = ("app", "options", "tracking")

    def __init__(self, app: AnyASGIApp, options: Options, tracking: Tracking | None) -> None:
        self.app = app
        self.options = options
        self.tracking = tracking

    async def run(self, scope: Scope, receive: Receive, send: Send) -> Any:
        """Run one request; returns what the app returned."""
        cycle = new_cycle(scope, receive, send, self.options, TrioRunner)
        tracking = self.tracking
        if tracking is not None:  # ids or deadlines: only when the options ask for them
            refused = tracking.begin(cycle)
            if refused is not None:
                cycle.finished()
                await refused
                return None
            send = cycle.real_send  # its completion, too, carries the request's id
        runner: TrioRunner = cycle.ensure_runner()  # type: ignore[assignment]
        token = cycle.token
        error: BaseException | None = None
        result = None
        try:
            async with trio.open_nursery() as nursery:
                runner.nursery = nursery
                if tracking is not None:
                    runner.track(tracking)
                nursery.start_soon(runner.watch_in_scope)
                try:
                    with runner.app_scope:
                        result = await self.app(scope, cycle.receive, cycle.send)
                except asyncio.CancelledError:
                    # raise_if_cancelled() in a worker thread: asyncio's exception, trio's
                    # meaning.
                    if not token.cancelled:
                        raise
                except BaseException as exc:  # re-raised below, outside the nursery's group
                    error = exc
                finally:
                    cycle.finished()  # (the nursery waits for the runner's tasks)
        except BaseExceptionGroup as group:
            # An outside cancellation also cancels the watcher; its Cancelled must not replace
            # the app's own exception.
            _, rest = group.split(trio.Cancelled)
            if error is None or rest is not None:
                raise
        finally:
            runner.nursery = None
        if error is not None:
            raise error
        if token.cancelled:
            with trio.move_on_after(COMPLETION_TIMEOUT) as bound:
                await complete_cancelled(cycle, receive, send)
            if bound.cancelled_caught:
                logger.debug("the server's send did not return; not completing")
        return result


class TrioRunner:
    """One request's trio side: parked callers, the app's and the watcher's cancel scopes."""

    __slots__ = (
        "app_scope",
        "cycle",
        "deadline_scope",
        "grace_scope",
        "nursery",
        "parked",
        "thread",
        "tracking",
        "trio_token",
        "watch_scope",
        "watching",
    )

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle
        self.parked = trio.lowlevel.ParkingLot()
        self.app_scope = trio.CancelScope()
        self.watch_scope = trio.CancelScope()
        self.watching = True  # started with the app: until cycle.watch() returns
        self.grace_scope = trio.CancelScope()
        self.nursery: trio.Nursery | None = None
        self.deadline_scope: trio.CancelScope | None = None
        self.tracking: Tracking | None = None
        self.trio_token = trio.lowlevel.current_trio_token()
        self.thread = threading.get_ident()

    def track(self, tracking: Tracking) -> None:
        """Make the request findable by id, and start its deadline's task if it has one."""
        self.tracking = tracking
        tracking.register(self.cycle, trio.lowlevel.current_trio_token().run_sync_soon)
        deadline = self.cycle.token.deadline
        if deadline is not None and self.nursery is not None:
            # Made here, not in the task: cancelled before it starts, it still ends.
            self.deadline_scope = trio.CancelScope()
            self.nursery.start_soon(self.wait_deadline, deadline)

    def close(self) -> bool:
        """The app has returned: end the watcher, the grace period and the deadline's wait
        (the nursery waits for them), and leave the registry."""
        self.watch_scope.cancel()
        self.grace_scope.cancel()
        if self.deadline_scope is not None:
            self.deadline_scope.cancel()
        if self.tracking is not None:
            self.tracking.unregister(self.cycle)
        return False

    async def watch_in_scope(self) -> None:
        try:
            with self.watch_scope:
                await self.cycle.watch()
        finally:
            self.watching = False

    def watch_now(self) -> bool:
        return self.watching

    async def wait_deadline(self, deadline: float) -> None:
        with self.deadline_scope or trio.CancelScope():
            await trio.sleep(max(0.0, deadline - monotonic()))
            self.cycle.stop(DEADLINE_EXCEEDED, DEADLINE_STATUS)

    async def park(self) -> None:
        await self.parked.park()

    def wake(self) -> None:
        if self.parked:
            self.parked.unpark_all()

    async def cancel_body_reader(self) -> None:
        # Trio's cancellation is level-triggered: a cancelled app meets it at its next
        # checkpoint anyway, a worker thread's included.
        await trio.lowlevel.checkpoint()

    async def checkpoint(self) -> None:
        await trio.lowlevel.checkpoint()

    def cancel_app(self) -> None:
        if self.cycle.state is not _FINISHED:
            self.app_scope.cancel()

    def cancel_app_soon(self) -> None:
        if threading.get_ident() == self.thread:
            self.cancel_app()  # a cancelled scope: the app's next checkpoint raises
        else:  # the shield() block was sync code in a worker thread
            self.trio_token.run_sync_soon(self.cancel_app)

    def start_grace(self) -> None:
        self.grace_scope.deadline = trio.current_time() + self.cycle.options.grace
        if self.nursery is not None:
            self.nursery.start_soon(self._wait_grace)

    async def _wait_grace(self) -> None:
        with self.grace_scope:
            await trio.sleep_forever()
        if self.cycle.state is State.RESPONSE_COMPLETE:
            self.cycle.final_send_hung()
        elif self.cycle.state is not _FINISHED:
            self.cycle.token.cancel_app()

    def spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> None:
            try:
                await awaitable
            except Exception:
                logger.exception("on_cancel task failed")

        if self.nursery is None:
            logger.warning("on_cancel awaitable after the request ended; not run")
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            return
        self.nursery.start_soon(run)
