"""The trio side of the middleware: a nursery for the watcher, a cancel scope for the app."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import trio

from ._cycle import Config, Cycle, logger, send_cancelled_response
from ._token import _current
from ._types import Receive, Scope, Send

if sys.version_info < (3, 11):  # trio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from ._middleware import CancelOnDisconnectMiddleware


async def run_trio(
    middleware: CancelOnDisconnectMiddleware, scope: Scope, receive: Receive, send: Send
) -> None:
    cycle = _TrioCycle(scope, receive, send, middleware)
    reset = _current.set(cycle)
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            cycle.nursery = nursery
            nursery.start_soon(cycle.watch_in_scope)
            try:
                with cycle.app_scope:
                    await middleware.app(scope, cycle.receive, cycle.send)
            except asyncio.CancelledError:
                # raise_if_cancelled() in a worker thread: asyncio's exception, trio's meaning.
                if not cycle._cancelled:
                    raise
            except BaseException as exc:  # re-raised below, outside the nursery's group
                error = exc
            finally:
                cycle.done = True
                cycle.watch_scope.cancel()
                cycle.grace_scope.cancel()
    except BaseExceptionGroup as group:
        # An outside cancellation also cancels the watcher; its Cancelled must not replace
        # the app's own exception.
        _, rest = group.split(trio.Cancelled)
        if error is None or rest is not None:
            raise
    finally:
        _current.reset(reset)
        cycle.nursery = None
    if error is not None:
        raise error
    if cycle._cancelled and not cycle.response_started:
        await send_cancelled_response(scope, send)


class _TrioCycle(Cycle):
    __slots__ = ("app_scope", "grace_scope", "nursery", "watch_scope")

    def __init__(self, scope: Scope, receive: Receive, send: Send, config: Config) -> None:
        super().__init__(scope, receive, send, config)
        self.lot = trio.lowlevel.ParkingLot()
        self.app_scope = trio.CancelScope()
        self.watch_scope = trio.CancelScope()
        self.grace_scope = trio.CancelScope()
        self.nursery: trio.Nursery | None = None

    async def watch_in_scope(self) -> None:
        with self.watch_scope:
            await self.watch()

    async def park(self) -> None:
        await self.lot.park()

    def wake(self) -> None:
        if self.lot:
            self.lot.unpark_all()

    def _cancel_app(self) -> None:
        if self.done or self.cancel_issued:
            return
        self.cancel_issued = True
        self.app_scope.cancel()

    def schedule_grace(self) -> None:
        self.grace_scope.deadline = trio.current_time() + self.config.grace
        if self.nursery is not None:
            self.nursery.start_soon(self._wait_grace)

    async def _wait_grace(self) -> None:
        with self.grace_scope:
            await trio.sleep_forever()
        if not self.done:
            self._request_cancel()

    async def checkpoint(self) -> None:
        await trio.lowlevel.checkpoint()

    def _spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> None:
            try:
                await awaitable
            except Exception:
                logger.exception("asgi_cancel: on_cancel task failed")

        if self.nursery is None:
            logger.warning("asgi_cancel: on_cancel awaitable after the request ended; not run")
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            return
        self.nursery.start_soon(run)
