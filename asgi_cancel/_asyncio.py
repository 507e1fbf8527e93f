"""The asyncio backend: the parts of a request that know asyncio.

The request itself runs in the middleware's `__call__`, in the server's task: it takes the
app's first step by hand to see whether it yields, so that a request that runs
to the end in one step (a hello world, a cached answer) costs a `Cycle` and nothing else: no
timer, no lane. One that yields has its first wait relayed to the task (`relayed`), the rest of
it resumed with no frame of ours between (`Cycle.__await__`), and is watched once it has run for
`watch_delay` seconds (`watch_after`): by a watcher stepped by hand (`_stepped.HandStepped`) on
the servers whose `receive()` awaits only the loop's futures, else in a task. Its `AsyncioLane`
cancels the server's task, once. A websocket session runs in `run_session`, watched from its
start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import types
from collections.abc import Awaitable, Generator, Iterable
from time import monotonic
from typing import Any, Protocol

from ._asyncio_lane import NO_CONTEXT, AsyncioLane, awaited, current_task
from ._cycle import Cycle
from ._responses import COMPLETION_TIMEOUT, complete_stopped, logger
from ._session import Session
from ._states import FINISHED, Options
from ._tracking import Tracking
from .types import AnyASGIApp, Receive, Scope, Send

__all__ = [
    "DONE",
    "LIBRARY",
    "AsyncioLane",
    "end_tasks",
    "propagating",
    "relayed",
    "run_session",
]

DONE: Any = object()  # an app that returned in its first step yielded nothing


@types.coroutine
def relayed(step: Any) -> Generator[Any, None, None]:
    """Hand `step` (what the app's first step yielded) to the task, as the app would have."""
    yield step


def watch_after(cycle: Cycle[AsyncioLane], delay: float) -> asyncio.TimerHandle | None:
    """The app waits: watch the request in `delay` seconds (at once for 0); the timer to cancel
    if it ends first. Until then the request has no lane: most never need one."""
    cycle.started_at = monotonic()
    task: asyncio.Task[Any] = current_task()
    cycle.app_task = task
    lane = cycle.lane
    if lane is not None:  # made in the app's first step, maybe in a worker thread
        lane.task = task
    if not delay:
        _start_watching(cycle)
        return None
    return task.get_loop().call_later(delay, _start_watching, cycle, context=NO_CONTEXT)


def _start_watching(cycle: Cycle[AsyncioLane]) -> None:
    if cycle.state is not FINISHED:
        cycle.ensure_lane().watch_now()


async def completed(cycle: Cycle[Any], receive: Receive, send: Send) -> None:
    """Complete a stopped request (`complete_stopped`)."""
    await bounded(complete_stopped(cycle, receive, send))


async def bounded(completion: Awaitable[None]) -> None:
    """Await the middleware's own completion of a stopped request, at most
    `COMPLETION_TIMEOUT` seconds: the server's send may never return on a dead connection."""
    try:
        await asyncio.wait_for(completion, COMPLETION_TIMEOUT)
    except asyncio.TimeoutError:
        logger.debug("the server's send did not return; not completing the response")


class SessionOptions(Options, Protocol):
    app: AnyASGIApp


async def run_session(
    options: SessionOptions, tracking: Tracking | None, scope: Scope, receive: Receive, send: Send
) -> Any:
    """A websocket connection on asyncio: watched from its start (in a frame of its own: a
    session's messages are not the hot path a request's first step is)."""
    session: Session[AsyncioLane] = Session(scope, receive, send, options, AsyncioLane)
    session.app_task = current_task()
    lane = session.ensure_lane()
    if tracking is not None:
        refused = tracking.begin(session)
        if refused is not None:
            session.finished()
            return await refused
        lane.track(tracking)
    lane.watch_now()
    result = None
    try:
        session.app = options.app(scope, session.receive, session.send)
        result = await session.app
    except asyncio.CancelledError:
        if not session.absorbs():
            raise  # from outside (server shutdown, an outer timeout): it goes on
    finally:
        session.finished()
        if lane.close():  # tasks the session started are left
            await end_tasks(lane, propagating())
    if session.stopped_with is not None:
        await bounded(session.complete(send))
    return result


def propagating() -> BaseException | None:
    """The exception leaving the request (in its `finally`): an outside cancellation, or the
    app's own error; None if it ended well (or by its own cancellation, absorbed)."""
    return sys.exc_info()[1]


async def end_tasks(lane: AsyncioLane, leaving: BaseException | None) -> None:
    """Wait for the tasks the request started (`AsyncioLane.wait_for_tasks`), even through an
    outside cancellation (`leaving` is one). One that comes again meanwhile (a level-triggered
    anyio scope) must not replace the app's own error (`leaving` is one), raised next."""
    outside = isinstance(leaving, asyncio.CancelledError)
    try:
        await lane.wait_for_tasks(outside)
    except asyncio.CancelledError:
        if leaving is None or outside:
            raise


class _Library:
    """What code outside a request needs from a running asyncio loop."""

    def event(self) -> asyncio.Event:
        return asyncio.Event()

    def shielded(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    async def wait_futures(
        self, futures: Iterable[concurrent.futures.Future[bool]], seconds: float
    ) -> tuple[set[concurrent.futures.Future[bool]], set[concurrent.futures.Future[bool]]]:
        handed = list(futures)
        wrapped = [asyncio.wrap_future(future) for future in handed]
        # The wrappers still pending are left alone: cancelling one would cancel the other
        # loop's work (its stop, still to run) with it.
        done, _ = await asyncio.wait(wrapped, timeout=seconds)
        finished = {
            original for original, mine in zip(handed, wrapped, strict=True) if mine in done
        }
        return finished, set(handed) - finished

    def spawn_detached(self, awaitable: Awaitable[object]) -> None:
        task = asyncio.get_running_loop().create_task(awaited(awaitable))
        _detached.add(task)
        task.add_done_callback(_detached.discard)


_detached: set[asyncio.Task[object]] = set()
LIBRARY = _Library()
