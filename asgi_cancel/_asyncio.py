"""The asyncio driver: run one request's app, watch its connection, cancel its task once.

A request that runs to the end in a single step (a hello world, a cached answer) costs a
`Cycle`, a token and nothing else: the app's first step is taken by hand to see whether it
yields. One that yields gets an `AsyncioLoop`, and a watcher task once it has run for
`watch_delay` seconds (at once for 0).
"""

from __future__ import annotations

import _asyncio
import asyncio
import contextvars
import sys
import types
from collections.abc import Awaitable, Callable, Generator
from time import monotonic
from typing import Any

from ._asyncio_task import in_anyio_shield, reacting, thread_future
from ._cycle import RELEASED, REQUEST_OVER, Cycle, Loop, Options, State, complete_cancelled, logger
from ._token import TokenSource, bind, run_detached, unbind
from ._tracking import DEADLINE_EXCEEDED, DEADLINE_STATUS, Tracking
from .types import AnyASGIApp, Receive, Scope, Send

_HAS_UNCANCEL = sys.version_info >= (3, 11)
_get_running_loop = asyncio.events._get_running_loop
_current_tasks: dict[object, Any] = getattr(_asyncio, "_current_tasks", {})


def _current_task_py() -> Any:  # 3.10, 3.11: asyncio.current_task is Python around this dict
    return _current_tasks.get(_get_running_loop())


_current_task: Callable[[], Any] = getattr(_asyncio, "current_task", _current_task_py)  # 3.12+


_CoroutineType = types.CoroutineType
_CLOSED: frozenset[asyncio.Task[object]] = frozenset()
_GRACE_HOPS = 3
_FINISHED = State.FINISHED
_READING_BODY = State.READING_BODY
_RESPONSE_COMPLETE = State.RESPONSE_COMPLETE
_NO_CONTEXT = contextvars.Context()
_NO_LOOP: Loop | None = None
_DONE = object()  # the first step, when the app returned in it (no StopIteration)


class AsyncioDriver:
    """Runs requests on asyncio for one middleware instance."""

    __slots__ = ("app", "options", "tracking")

    def __init__(self, app: AnyASGIApp, options: Options, tracking: Tracking | None) -> None:
        self.app = app
        self.options = options
        self.tracking = tracking

    def start(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None] | None:
        """Run the app's first step, by hand and synchronously, inside the middleware's own
        coroutine frame (no coroutine of ours per request). Returns None when the request is
        over, else what the middleware must await for the rest of it."""
        # new_cycle(scope, receive, send, self.options, _attach), inlined: a call costs ~0.5k
        # instructions, 5% of a hello world's budget (tests/test_cycle.py checks that the two
        # build the same cycle).
        cycle = Cycle()
        cycle.scope = scope
        cycle.real_receive = receive
        cycle.real_send = send
        cycle.options = self.options
        cycle.attach = _attach
        cycle.token_if_made = None
        cycle.state = _READING_BODY
        cycle.disconnect = None
        cycle.first_sent = None
        cycle.last_sent = None
        cycle.loop = _NO_LOOP  # (typed `Loop | None`: a literal None would narrow it for mypy)
        cycle.body_complete = False
        cycle.reading = False
        cycle.app_waiting = 0
        cycle.buffer = None
        cycle.buffered = 0
        if self.tracking is not None:  # ids or deadlines: only when the options ask for them
            refused = self.tracking.begin(cycle)
            if refused is not None:
                return refused
            tracked: AsyncioLoop = cycle.attached()  # type: ignore[assignment]
            tracked.track(self.tracking)
        reset = bind(cycle)
        app = self.app
        coroutine: Any = app(scope, cycle.receive, cycle.send)
        # An iterator over the app's steps (a coroutine's wrapper), stepped once by a for loop:
        # when the app returns, the loop ends without a StopIteration raised (~0.9k
        # instructions less than catching it, and ~0.1k less than `next(steps, default)`).
        steps = coroutine.__await__()
        step = _DONE
        try:
            for step in steps:  # noqa: B007  (the first step only)
                break
        except BaseException as exc:
            return _rest(cycle, reset, None, None, exc)
        if step is _DONE:
            # It never yielded: nothing was watched, nothing to wait for (unless the app read a
            # disconnect itself in that step, or it was cancelled by id: then the rest is the
            # slow path's).
            done: AsyncioLoop | None = cycle.loop  # type: ignore[assignment]
            if done is None:  # (the cycle fires the token only through its loop)
                # cycle.finished(), inlined: a call costs ~0.5k instructions, 5% of the budget
                # of a request that never waits.
                cycle.state = _FINISHED
                if cycle.token_if_made is not None:
                    cycle.token_if_made.release()
                if cycle.disconnect is None:
                    cycle.disconnect = REQUEST_OVER
                cycle.real_receive = cycle.real_send = RELEASED
                unbind(reset)
                return None
            token = cycle.token_if_made
            cancelled = token is not None and token.cancelled
            if not cancelled and done.watcher is None and not done.spawned:
                # A tracked request (an id, a deadline) has its loop from the start: ended
                # here too (its timer cancelled, its id unregistered), without the slow path.
                cycle.finished()
                done.close()
                unbind(reset)
                cycle.loop = done.task = None  # type: ignore[assignment]
                return None
            return _rest(cycle, reset, None, None, None)
        loop: AsyncioLoop | None = cycle.loop  # type: ignore[assignment]
        if loop is None:  # cycle.attached(), inlined (a call costs ~0.5k instructions)
            loop = cycle.loop = _attach(cycle)
            cycle.started_at = monotonic()
        # From here on the app's own coroutine, not its wrapper: one layer less per resumption,
        # and thread_future() walks its await chain.
        if type(coroutine) is _CoroutineType:
            steps = coroutine
        loop.app_awaitable = steps
        delay = self.options.watch_delay
        # An empty context: the watcher must not carry one request's context variables (a
        # request id in a log line) into code that runs for it. Shared: callbacks never nest.
        if delay:
            running = _get_running_loop()  # (the C function: `task.get_loop()` costs more)
            loop.watch_timer = running.call_later(  # type: ignore[union-attr]  # (never None here)
                delay, loop.start_watching, context=_NO_CONTEXT
            )
        else:
            _NO_CONTEXT.run(loop.start_watching)
        return _rest(cycle, reset, steps, step, None)


@types.coroutine
def _rest(
    cycle: Cycle,
    reset: contextvars.Token[TokenSource],
    awaitable: Any,
    step: Any,
    error: BaseException | None,
) -> Generator[Any, Any, None]:
    """The rest of a request whose first step yielded (or ended unusually).

    A generator-based coroutine that goes on with the app itself (one frame per request and
    per resumption less than awaiting a helper): asyncio resumes a task with `send(None)` or
    `throw(exc)`; once resumed with None, the rest is a plain `yield from`.
    """
    outside = False
    send = cycle.real_send  # (let go by finished(); a cancelled request's end still needs it)
    try:
        if error is not None:
            raise error
        while awaitable is not None:
            try:
                sent = yield step
            except GeneratorExit:
                awaitable.close()
                raise
            except BaseException as exc:
                try:
                    step = awaitable.throw(exc)
                except StopIteration:
                    break
                continue
            if sent is None:
                yield from awaitable
                break
            try:  # pragma: no cover - asyncio's tasks always send None
                step = awaitable.send(sent)
            except StopIteration:  # pragma: no cover
                break
    except asyncio.CancelledError:
        loop: AsyncioLoop | None = cycle.loop  # type: ignore[assignment]
        if loop is not None and loop.cancel_issued:
            if _HAS_UNCANCEL and loop.task.uncancel():  # type: ignore[attr-defined,unused-ignore]
                raise  # ours, and someone else's too
        elif not cycle.cancelled or (_HAS_UNCANCEL and _current_task().cancelling()):
            outside = True  # not ours: server shutdown or an outer timeout
            raise
        # Otherwise the app raised it itself once the client had gone (raise_if_cancelled()
        # in a worker thread during the grace period or a shield): absorbed like ours.
    except BaseException:
        loop = cycle.loop  # type: ignore[assignment]
        if loop is not None and loop.cancel_issued and _HAS_UNCANCEL:
            loop.task.uncancel()  # type: ignore[attr-defined,unused-ignore]  # became an error
        raise
    else:
        loop = cycle.loop  # type: ignore[assignment]
        if loop is not None and loop.cancel_issued and _HAS_UNCANCEL:
            loop.task.uncancel()  # type: ignore[attr-defined,unused-ignore]  # app swallowed it
    finally:
        cycle.finished()
        loop = cycle.loop  # type: ignore[assignment]
        try:
            if loop is not None and not loop.close():
                yield from loop.finish(outside).__await__()
        finally:
            unbind(reset)
            if loop is not None:
                # cycle <-> loop: broken here so that reference counting frees them.
                cycle.loop = loop.task = None  # type: ignore[assignment]
    token = cycle.token_if_made  # (not the `cancelled` property: a property costs ~0.6k)
    if token is not None and token.cancelled:
        yield from complete_cancelled(cycle, send).__await__()


class AsyncioLoop:
    """One request's asyncio side: its task, parked callers, watcher, timers, spawned tasks."""

    __slots__ = (
        "app_awaitable",
        "cancel_issued",
        "cycle",
        "deadline_timer",
        "grace_timer",
        "lot",
        "spawned",
        "task",
        "tracking",
        "watch_timer",
        "watcher",
    )

    app_awaitable: Any
    cancel_issued: bool
    lot: list[asyncio.Future[None]] | None
    watcher: asyncio.Task[None] | None
    watch_timer: asyncio.TimerHandle | None
    grace_timer: asyncio.TimerHandle | None
    spawned: set[asyncio.Task[object]] | frozenset[asyncio.Task[object]] | None
    tracking: Tracking | None
    deadline_timer: asyncio.TimerHandle | None
    cycle: Cycle
    task: asyncio.Task[Any]

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

    def start_watching(self) -> None:
        self.watch_timer = None
        cycle = self.cycle
        if cycle.disconnect is None and self.watcher is None:
            self.watcher = self.task.get_loop().create_task(cycle.watch())

    # -- Loop ------------------------------------------------------------------------------------
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

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def cancel_app(self) -> None:
        if self.cycle.state is _FINISHED or self.cancel_issued:
            return
        task = self.task
        loop = task.get_loop()
        if _HAS_UNCANCEL and task.cancelling():  # type: ignore[attr-defined,unused-ignore]
            # Someone else is cancelling the app (server shutdown, an anyio scope, the app's
            # own task group): a second cancel would cut the cleanup it runs short. Look again
            # after `grace`, in case the app caught that cancellation and went on working.
            self.grace_timer = loop.call_later(self.cycle.options.grace, self._look_again)
            return
        if thread_future(task, self.app_awaitable) is not None or in_anyio_shield(task):
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
        # cancel issued now would land in the server's code instead. One hop lets FINISHED win.
        if self.cycle.state is not _FINISHED:
            self.task.get_loop().call_soon(self.cancel_app)

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
            logger.debug("asgi_cancel: the app handles the disconnect itself")
        else:
            cycle.token.cancel_app()  # it listened and ignored the disconnect

    def spawn(self, awaitable: Awaitable[object], /) -> None:
        async def run() -> object:
            return await awaitable

        spawned = self.spawned
        if self.cycle.state is _FINISHED and not isinstance(spawned, set):
            # The request is over (or finishing without a finish() to wait for it).
            run_detached(awaitable)
            return
        if spawned is None or not isinstance(spawned, set):
            spawned = self.spawned = set()
        spawned.add(self.task.get_loop().create_task(run()))

    def close(self) -> bool:
        """Cancel the timers; return whether that was all (no task to wait for)."""
        if self.watch_timer is not None:
            self.watch_timer.cancel()
            self.watch_timer = None
        if self.grace_timer is not None:
            self.grace_timer.cancel()
            self.grace_timer = None
        self.app_awaitable = None
        if self.tracking is not None:
            self.tracking.unregister(self.cycle)
            if self.deadline_timer is not None:
                self.deadline_timer.cancel()
                self.deadline_timer = None
        return self.watcher is None and not self.spawned

    async def finish(self, outside: bool) -> None:
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
            watcher.cancel()
            if not outside:
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


def _attach(cycle: Cycle) -> AsyncioLoop:
    """A cycle's `AsyncioLoop`, made in the request's task. No `__init__` (a Python `__init__`
    called from C costs ~0.5k instructions), and slots rather than class-level defaults: a
    default read through an instance is not specialised (~0.2k each, and `close()` reads five)."""
    loop = AsyncioLoop()
    loop.cycle = cycle
    loop.task = _current_task()
    loop.app_awaitable = None
    loop.cancel_issued = False
    loop.lot = None
    loop.watcher = None
    loop.watch_timer = None
    loop.grace_timer = None
    loop.spawned = None
    loop.tracking = None
    loop.deadline_timer = None
    return loop


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
