"""The asyncio driver: run one request's app, watch its connection, cancel its task once.

A request that runs to the end in a single step (a hello world, a cached answer) costs a
`Cycle` and nothing else: the driver takes the app's first step by hand (`first_step`) to see
whether it yields, so that such a request needs no task, no timer and no coroutine of ours.
One that yields gets an `AsyncioRunner`, and a watcher task once it has run for `watch_delay`
seconds (at once for 0).
"""

from __future__ import annotations

import _asyncio
import asyncio
import contextvars
import sys
import types
from collections.abc import Awaitable, Callable, Generator, Iterator
from time import monotonic
from typing import Any

from ._asyncio_task import in_anyio_shield, reacting, thread_future, woken
from ._cycle import Cycle, Options, State, logger, new_cycle
from ._responses import COMPLETION_TIMEOUT, complete_cancelled
from ._token import current_source, run_detached
from ._tracking import DEADLINE_EXCEEDED, DEADLINE_STATUS, Tracking
from .types import AnyASGIApp, Receive, Scope, Send

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
_current_task: Callable[[], Any] = getattr(
    _asyncio, "current_task", lambda: _current_tasks.get(_get_running_loop())
)

_CLOSED: frozenset[asyncio.Task[object]] = frozenset()
_GRACE_HOPS = 3
_FINISHED = State.FINISHED
_RESPONSE_COMPLETE = State.RESPONSE_COMPLETE
# The watcher's and the timers' context: they must not carry one request's context variables
# (a request id in a log line) into code that runs for it. Shared: callbacks never nest.
_NO_CONTEXT = contextvars.Context()
DONE: Any = object()  # what `first_step` returns for an app that returned in its first step


def first_step(steps: Iterator[Any]) -> Any:
    """Take the app's first step by hand: what it yielded to the event loop, or `DONE`.

    A `for` loop ends without a `StopIteration` reaching Python when the app returns, the
    cheapest way to run a coroutine one step outside a task. The price: what an app returns
    without ever awaiting is not seen (the middleware returns None for it).
    """
    for step in steps:
        return step
    return DONE


class AsyncioDriver:
    """Runs requests on asyncio for one middleware instance."""

    __slots__ = ("app", "options", "tracking")

    def __init__(self, app: AnyASGIApp, options: Options, tracking: Tracking | None) -> None:
        self.app = app
        self.options = options
        self.tracking = tracking

    def start(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[Any] | None:
        """Run the app's first step in the middleware's own frame. Returns None when the
        request is over, else what the middleware must await for the rest of it (which returns
        what the app returned)."""
        cycle = new_cycle(scope, receive, send, self.options, new_runner)
        if self.tracking is not None:  # ids or deadlines: only when the options ask for them
            refused = self.tracking.begin(cycle)
            if refused is not None:
                cycle.finished()
                return refused
            runner_of(cycle).track(self.tracking)
        coroutine = self.app(scope, cycle.receive, cycle.send)
        steps = coroutine.__await__()
        try:
            step = first_step(steps)
        except BaseException as error:
            return _rest_of_request(cycle, error=error)
        if step is DONE:
            if cycle.cancelled:  # (its response is to be completed)
                return _rest_of_request(cycle)
            # Nothing can be left to wait for: a watcher starts only after the first step, a
            # callback's task only once the token fired.
            cycle.finished()
            return None
        # The app's own coroutine rather than its wrapper: one layer less per resumption, and
        # thread_future() walks its await chain.
        app = coroutine if type(coroutine) is types.CoroutineType else steps
        cycle.app_task = _current_task()
        cycle.app_awaitable = app
        cycle.started_at = monotonic()
        timer = watch_after(cycle, self.options.watch_delay)
        return _rest_of_request(cycle, app, step, timer)


def watch_after(cycle: Cycle, delay: float) -> asyncio.TimerHandle | None:
    """Start the request's watcher in `delay` seconds (at once for 0); the timer to cancel if
    the request ends first. Until then the request has no runner: most never need one."""
    if not delay:
        _NO_CONTEXT.run(start_watching, cycle)
        return None
    loop = _get_running_loop()
    assert loop is not None
    return loop.call_later(delay, start_watching, cycle, context=_NO_CONTEXT)


def runner_of(cycle: Cycle) -> AsyncioRunner:
    """The cycle's runner (made on first need), as the asyncio driver's own type."""
    runner = cycle.ensure_runner()
    assert isinstance(runner, AsyncioRunner)
    return runner


def start_watching(cycle: Cycle) -> None:
    if cycle.disconnect is None and cycle.state is not _FINISHED:
        runner = runner_of(cycle)
        if runner.watcher is None:
            runner.watcher = runner.task.get_loop().create_task(cycle.watch())


@types.coroutine
def _rest_of_request(
    cycle: Cycle,
    app: Any = None,
    step: Any = None,
    timer: asyncio.TimerHandle | None = None,
    *,
    error: BaseException | None = None,
) -> Generator[Any, Any, Any]:
    """The rest of a request: go on with the app from `step` (what its first step yielded),
    decide what a `CancelledError` means, end the request, complete a cancelled response.
    Returns what the app returned.

    A generator-based coroutine: it goes on with the app itself, with no frame of ours between
    the task and the app once resumed (`yield from`).
    """
    # Let go by finished(); a cancelled request's end still needs them.
    receive, send = cycle.real_receive, cycle.real_send
    outside = failed = False
    result = None
    try:
        if error is not None:
            raise error
        while app is not None:
            # The task resumes us as it would the app: with `send(None)` (then the rest is the
            # app's own `yield from`), or by throwing a cancellation in, which the app gets at
            # its await.
            try:
                yield step
            except BaseException as exc:
                try:
                    step = app.throw(exc)
                except StopIteration as returned:
                    result = returned.value
                    break
            else:
                result = yield from app
                break
    except asyncio.CancelledError:
        if not absorbs_cancellation(cycle):
            outside = True  # server shutdown, an outer timeout: it goes on
            raise
    except BaseException:
        failed = True  # the app's own error: it goes on
        raise
    finally:
        if timer is not None:
            timer.cancel()
        cycle.app_task = cycle.app_awaitable = None
        runner = cycle.finished()
        if runner is not None:  # tasks are left: the watcher, an on_cancel callback's
            assert isinstance(runner, AsyncioRunner)
            try:
                yield from runner.wait_for_tasks(outside).__await__()
            except asyncio.CancelledError:
                # A level-triggered outside cancellation (an anyio scope) came again while we
                # waited: it must not replace the app's own error, which the scope gets next.
                if not failed:
                    raise
    if cycle.cancelled:
        yield from _bounded(complete_cancelled(cycle, receive, send)).__await__()
    return result


def runs_the_request(task: asyncio.Task[Any]) -> bool:
    """Whether `task` is the current request's own task (the one the middleware cancels), not
    one the app spawned. Before the app's first yield nothing else of it can run."""
    cycle = current_source()
    if not isinstance(cycle, Cycle):
        return False
    return cycle.app_task is None or cycle.app_task is task


def absorbs_cancellation(cycle: Cycle) -> bool:
    """A `CancelledError` ended the app: whether the middleware absorbs it (it is the one it
    caused) rather than re-raise it (a cancellation from outside: shutdown, a timeout).

    Ours when the runner issued a `Task.cancel()` and, on 3.11+, nobody else cancelled the
    task too (`uncancel()`); or when the app raised it itself once the token had fired
    (`raise_if_cancelled()` in a worker thread) and no outside cancellation is pending.
    """
    runner = cycle.runner
    if runner is None:
        return False  # the token fires only through a runner: nothing of ours happened
    assert isinstance(runner, AsyncioRunner)
    if runner.cancel_issued:
        runner.cancel_issued = False
        return not uncancel(runner.task)
    return cycle.cancelled and not cancelling(runner.task)


async def _bounded(completion: Awaitable[None]) -> None:
    """Await the middleware's own completion of a cancelled request, at most
    `COMPLETION_TIMEOUT` seconds: the server's send may never return on a dead connection."""
    try:
        await asyncio.wait_for(completion, COMPLETION_TIMEOUT)
    except asyncio.TimeoutError:
        logger.debug("the server's send did not return; not completing the response")


def new_runner(cycle: Cycle) -> AsyncioRunner:
    """A new `AsyncioRunner`: its constructor, as a plain function for the same reason as
    `new_cycle()`. Made in the request's task unless its app already yielded (then possibly
    in another: a watcher's timer, a task of the app's that calls `receive()`)."""
    runner = AsyncioRunner()
    runner.cycle = cycle
    runner.task = cycle.app_task if cycle.app_task is not None else _current_task()
    runner.cancel_issued = False
    runner.parked = None
    runner.watcher = None
    runner.grace_timer = None
    runner.spawned = _CLOSED
    runner.tracking = None
    runner.deadline_timer = None
    return runner


class AsyncioRunner:
    """One request's asyncio side: its task, parked callers, watcher, timers, spawned tasks."""

    __slots__ = (
        "cancel_issued",
        "cycle",
        "deadline_timer",
        "grace_timer",
        "parked",
        "spawned",
        "task",
        "tracking",
        "watcher",
    )

    cycle: Cycle
    task: asyncio.Task[Any]  # the request's own
    cancel_issued: bool  # our one Task.cancel() is in flight
    parked: list[asyncio.Future[None]] | None  # app callers waiting for the watcher
    watcher: asyncio.Task[None] | None
    grace_timer: asyncio.TimerHandle | None
    spawned: set[asyncio.Task[object]] | frozenset[asyncio.Task[object]]  # callbacks' tasks
    tracking: Tracking | None
    deadline_timer: asyncio.TimerHandle | None

    def track(self, tracking: Tracking) -> None:
        """Make the request findable by id, and arm its one deadline timer if it has one."""
        self.tracking = tracking
        loop = self.task.get_loop()
        tracking.register(self.cycle, loop.call_soon_threadsafe)
        deadline = self.cycle.token.deadline
        if deadline is not None:
            self.deadline_timer = loop.call_later(
                deadline - monotonic(), self._deadline_passed, context=_NO_CONTEXT
            )

    def _deadline_passed(self) -> None:
        self.deadline_timer = None
        self.cycle.stop(DEADLINE_EXCEEDED, DEADLINE_STATUS)

    # -- Runner ----------------------------------------------------------------------------------
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

    def watch_now(self) -> bool:
        if self.watcher is None:
            _NO_CONTEXT.run(start_watching, self.cycle)
        watcher = self.watcher
        return watcher is not None and not watcher.done()

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def cancel_app(self) -> None:
        if self.cycle.state is _FINISHED or self.cancel_issued:
            return
        task = self.task
        if cancelling(task):
            # Someone else is cancelling the app (server shutdown, an anyio scope, the app's
            # own task group): a second cancel would cut the cleanup it runs short. Look again
            # after `grace`, in case the app caught that cancellation and went on working.
            self.grace_timer = task.get_loop().call_later(
                self.cycle.options.grace, self._look_again
            )
            return
        if thread_future(task, self.cycle.app_awaitable) is not None or in_anyio_shield(task):
            # The app waits for a worker thread (a threadpool endpoint, sync_to_async) or
            # runs a framework's cleanup in an anyio shielded scope (FastAPI's dependency
            # exits): a cancel now would unwind the request while the thread still uses its
            # resources, or cut that cleanup short. The token has fired, so code that checks
            # it stops; look again when the app's current wait ends, so that the cancellation
            # lands at its first await outside them (no polling).
            self._look_again_after_wait()
            return
        self.cancel_issued = True
        task.cancel()  # once: edge-triggered, so the app's cleanup can await freely

    def _look_again_after_wait(self) -> None:
        # Done callbacks run in the order they were added: this one after the app task's own
        # wake-up, so the app has resumed and reached its next await (or ended) when it runs.
        waiter: asyncio.Future[Any] | None = getattr(self.task, "_fut_waiter", None)
        if waiter is None:
            self.task.get_loop().call_soon(self._look_again)
        else:
            waiter.add_done_callback(self._look_again)

    def _look_again(self, _: object = None) -> None:
        # Through the token, so that a shield() entered meanwhile is honoured.
        if self.cycle.state is not _FINISHED and not self.cancel_issued:
            self.cycle.token.cancel_app()

    async def cancel_body_reader(self) -> None:
        """The app reads its body after the client left mid-body: cancel it here, unless its
        cancellation must wait (a shield): then it meets `http.disconnect`, as ASGI says."""
        if self.task is _current_task() and not self.cancel_issued:
            self.cycle.token.cancel_app()
            if self.cancel_issued:
                await asyncio.sleep(0)  # the cancellation lands here

    def cancel_app_soon(self) -> None:
        # From inside the app (a shield() exit): if the app then returns without awaiting, a
        # cancel issued now would land in the server's code instead. One hop lets FINISHED win,
        # and through the token, so that a shield() the app enters meanwhile is honoured.
        if self.cycle.state is not _FINISHED:
            # (thread-safe: the block may be sync code in a worker thread)
            self.task.get_loop().call_soon_threadsafe(self._look_again)

    def start_grace(self) -> None:
        self.grace_timer = self.task.get_loop().call_later(
            self.cycle.options.grace, self._grace_over, _GRACE_HOPS
        )

    def _grace_over(self, hops: int) -> None:
        # A few more loop iterations before deciding: on a loop that was busier than `grace`
        # (a GC pause, a burst of engine outputs), the app's own reaction may still be queued:
        # vLLM's with_cancellation needs three steps (listener ends, asyncio.wait completes,
        # the wrapper resumes) before it cancels its inner handler task. Cancelling the
        # wrapper earlier would orphan that task.
        self.grace_timer = None
        cycle = self.cycle
        if cycle.state is _FINISHED:
            return
        if hops:
            self.task.get_loop().call_soon(self._grace_over, hops - 1)
        elif cycle.state is _RESPONSE_COMPLETE:
            cycle.final_send_hung()
        elif reacting(self.task, cycle):
            # The app reacted by cancelling its own work (Django, Quart, Starlette's stream
            # listener): that cleanup is the app's, however long it takes. No second cancel.
            logger.debug("the app handles the disconnect itself")
        else:
            cycle.token.cancel_app()  # it listened and ignored the disconnect

    def spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> object:
            return await awaitable

        if self.cycle.state is _FINISHED and self.spawned is _CLOSED:
            # The request is over (or finishing without waiting for tasks).
            run_detached(awaitable)
            return
        if self.spawned is _CLOSED:
            self.spawned = set()
        assert isinstance(self.spawned, set)
        self.spawned.add(self.task.get_loop().create_task(run()))

    def close(self) -> bool:
        """The app has returned: cancel the timers, leave the registry, and withdraw a
        `Task.cancel()` the app did not end by (it swallowed it, or turned it into an error),
        so that the task is not left cancelling. Returns whether tasks are left to wait for
        (`wait_for_tasks()`): the watcher, or tasks an `on_cancel` callback started."""
        if self.cancel_issued:
            self.cancel_issued = False
            uncancel(self.task)
        if self.grace_timer is not None:
            self.grace_timer.cancel()
            self.grace_timer = None
        if self.tracking is not None:
            self.tracking.unregister(self.cycle)
            if self.deadline_timer is not None:
                self.deadline_timer.cancel()
                self.deadline_timer = None
        return self.watcher is not None or bool(self.spawned)

    async def wait_for_tasks(self, outside: bool) -> None:
        """Stop watching and wait for callback tasks, even through a server shutdown.

        Under an outside cancellation the watcher, parked in the server's `receive()`, is
        cancelled and not waited for: it ends on its next step, and the cancellation is
        re-raised at once (uvicorn stops its loop a few iterations after cancelling the
        requests at shutdown; waiting for the watcher hid the request's end from everything
        outside the middleware)."""
        interrupted = False
        watcher = self.watcher
        if watcher is not None:
            # Dropped first: the cancelled task's traceback holds watch()'s frame, which
            # holds the cycle, so keeping it would leave a reference cycle for the GC.
            self.watcher = None
            if outside or not woken(watcher):
                watcher.cancel()
            else:
                # Its wait is over (uvicorn answers the watcher's receive() once the response
                # is complete): its next step, already due, ends it (the request is finished),
                # with no CancelledError through its frames; should it wait again, it is
                # cancelled then.
                watcher.get_loop().call_soon(watcher.cancel)
            if not outside:
                interrupted = await _wait_out([watcher])
        spawned = self.spawned
        while spawned:
            # Callbacks' tasks (engine aborts) must finish: the app's cleanup may rely on them.
            assert isinstance(spawned, set)
            tasks = list(spawned)
            interrupted = await _wait_out(tasks) or interrupted
            spawned.difference_update(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    logger.error("on_cancel task failed", exc_info=task.exception())
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
